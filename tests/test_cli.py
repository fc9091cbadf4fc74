from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trl_gc_plugin import RULES
from trl_gc_plugin.core.table import README_BEGIN, compact, document, markdown

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


def test_the_rules_doc_is_generated_from_the_rules():
    """`docs/rules.md` (the short table and the full one) is what `make readme` writes; the README links to it."""
    stale = "docs/rules.md is stale: regenerate it with `make readme`"
    doc = (ROOT / "docs" / "rules.md").read_text()
    assert doc == document(), stale
    assert compact() in doc and markdown() in doc
    assert "trl_gc_plugin/core/rules.py" in doc and "trl_gc_plugin/rules.py" not in doc
    assert "core/capabilities.py" in doc and "`trl_gc_plugin/capabilities.py`" not in doc
    readme = (ROOT / "README.md").read_text()
    assert README_BEGIN not in readme and "(docs/rules.md)" in readme
    assert run("rules", "--markdown").strip() == markdown().strip()
