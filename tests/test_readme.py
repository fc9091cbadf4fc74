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
