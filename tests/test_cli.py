from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trl_gc_plugin import RULES
from trl_gc_plugin.core.table import DOC_HEADER, README_BEGIN, README_END, compact, markdown

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str) -> str:
    return subprocess.run([sys.executable, "-m", "trl_gc_plugin", *argv], capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout


def test_rules_lists_every_rule_with_its_evidence_and_versions():
    out = run("rules")
    for rule in RULES:
        assert rule.id in out and rule.evidence[0] in out
    assert "applies where: activation_fields (read on transformers >=5.23)" in out


def test_rules_json_is_the_table():
    assert [r["id"] for r in json.loads(run("rules", "--json"))] == [r.id for r in RULES]


def test_readme_and_rules_doc_are_generated_from_the_rules():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(README_BEGIN) + len(README_BEGIN): readme.index(README_END)].strip()
    stale = "the rule tables are stale: regenerate them with `make readme`"
    assert block == compact().strip(), stale
    assert (ROOT / "docs" / "rules.md").read_text() == DOC_HEADER + markdown() + "\n", stale
    assert run("rules", "--markdown").strip() == markdown().strip()
