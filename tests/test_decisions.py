from __future__ import annotations

import json
import logging

from trl_gc_plugin import Decision, Facts, decide
from trl_gc_plugin._base.report import is_main_process, log_decisions
from trl_gc_plugin.core.decisions import write_decisions


def sample() -> list[Decision]:
    return decide(Facts(gc_enabled=True, use_reentrant="false", use_reentrant_source="user", use_cache=True,
                        versions={"transformers": "4.57.6"}))


def test_round_trip_through_json(tmp_path):
    decisions = sample()
    (tmp_path / "run").mkdir()
    path = write_decisions(decisions, tmp_path / "run")
    assert path and path.endswith("gc_decisions.json")
    with open(path) as fh:
        data = json.load(fh)
    assert {"rule_id", "action", "setting", "before", "after", "source", "reason", "evidence", "applied",
            "stage", "level"} <= set(data[0])
    assert [Decision.from_dict(item) for item in data] == decisions
    assert Decision.from_dict(json.loads(json.dumps(decisions[0].to_dict(), default=repr))) == decisions[0]


def test_no_output_dir_writes_nothing_and_creates_no_directory(tmp_path):
    assert write_decisions(sample(), None) is None
    assert write_decisions(sample(), tmp_path / "missing") is None
    assert not (tmp_path / "missing").exists()


def test_log_levels_follow_actions(caplog):
    caplog.set_level(logging.INFO, logger="trl_gc_plugin")
    log_decisions(sample())
    levels = {r.getMessage().split("]")[0][1:]: r.levelname for r in caplog.records}
    assert levels["invalid-use-reentrant"] == "WARNING"
    assert levels["use-cache-off"] == "INFO"
    assert all(r.name == "trl_gc_plugin.decisions" for r in caplog.records)


def test_other_processes_log_nothing(caplog):
    caplog.set_level(logging.INFO, logger="trl_gc_plugin")
    log_decisions(sample(), main_process=False)
    assert caplog.records == []


def test_main_process_from_launcher_env(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert not is_main_process()
    monkeypatch.setenv("RANK", "0")
    assert is_main_process()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert not is_main_process()


def test_line_says_what_changed_and_who_set_it():
    d = sample()[0]
    assert d.line().startswith("[invalid-use-reentrant] repair: use_reentrant: 'false' -> False (set by user).")
    assert len(d.line()) < 400  # the long explanation is in the JSON and `python -m trl_gc_plugin rules`


def test_each_message_is_logged_once_per_process(caplog):
    caplog.set_level(logging.INFO, logger="trl_gc_plugin")
    log_decisions(sample())
    log_decisions(sample())
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(set(lines)) == len(sample())
