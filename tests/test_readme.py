"""The README's Python snippets run as written, and `make demo`'s script shows what it says, on a fresh process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 2


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRL_GC_PLUGIN")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_every_python_snippet_runs_as_written(index, tmp_path):
    proc = subprocess.run([sys.executable, "-c", SNIPPETS[index]], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(), timeout=600)
    assert proc.returncode == 0, f"README snippet {index} failed:\n{SNIPPETS[index]}\n{proc.stderr[-3000:]}"
    if "SafeGCCallback()" in SNIPPETS[index]:  # the comment says what the user sees: one line, and the file
        assert proc.stderr.count("[trl_gc_plugin] INFO: gradient checkpointing on") == 1, proc.stderr[-3000:]
        assert (tmp_path / "out" / "gc_decisions.json").exists()


def test_the_demo_shows_a_failure_without_the_plugin_and_none_with_it(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) <= 8, proc.stdout  # read in ten seconds
    without = next(line for line in lines if "without the plugin" in line)
    assert "0 of 18 layer parameters trained" in without or "wrong gradients" in without
    assert "refused before any update" in next(line for line in lines if "strict" in line)
    assert "updates equal to no checkpointing" in next(line for line in lines if "fix" in line)


def test_the_readme_is_read_in_five_minutes():
    """At most 250 lines (issue 46): what it does, the two commands, the routes, where the rest is."""
    lines = README.splitlines()
    assert len(lines) <= 250, len(lines)
    assert "make demo" in README and "make test" in README
    for route in ("SafeGCCallback()", "installed(", "TRL_GC_PLUGIN=1", "guard(model"):
        assert route in README, route


def test_every_section_the_readme_moved_is_in_docs():
    docs = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
    moved = {
        "compatibility.md": ["## Supported versions", "| capability | first transformers |", "`.venv-floor`"],
        "routes.md": ["## No code change: `TRL_GC_PLUGIN=1`", "## Where you launch", "## Axolotl", "## LLaMA-Factory",
                      "## Without a Trainer", "Start-up cost with the variable unset"],
        "how-it-works.md": ["### What it does, in short", "### Decisions", "### Modes"],
        "check.md": ["## In short (from the README)", "Exit status: 0 every file fine"],
        "memory-planning.md": ["**Candidates**", "**Micro-batch or checkpointing?**", "| llama3-70b, 8 grad shards |"],
        "troubleshooting.md": ["[frozen-inputs-need-non-reentrant]", "**Two registrations**"],
        "development.md": ["make matrix", "Layout: packages by concern"],
        "rules.md": ["Precedence: repairs first", "## At a glance", "## Every rule"],
    }
    for name, marks in moved.items():
        for mark in marks:
            assert mark in docs[name], (name, mark)


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
