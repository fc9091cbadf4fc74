"""The real `llamafactory-cli train` with `TRL_GC_PLUGIN=1`, on a tiny local Llama and a tiny local dataset, CPU,
two steps; and `trl-gc-check` on the same YAML. Skipped unless LLaMA-Factory is importable (it needs its own
environment: LLaMA-Factory 0.9.5 pins transformers 5.6 and TRL 0.24); marked `launchers`.

Run: `python -m pytest -p no:xdist -m launchers tests/test_launchers_llamafactory.py` in an environment with
LLaMA-Factory and the plugin installed editable (the editable install brings the `.pth` file that `TRL_GC_PLUGIN=1`
needs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llamafactory", reason="LLaMA-Factory is not installed")
pytestmark = pytest.mark.launchers

CLI = shutil.which("llamafactory-cli") or str(Path(sys.executable).with_name("llamafactory-cli"))
CHECK = [sys.executable, "-m", "trl_gc_plugin", "check", "--json"]

CASES = {
    "full-default": {"finetuning_type": "full"},
    "full-reentrant": {"finetuning_type": "full", "use_reentrant_gc": True},
    "full-non-reentrant": {"finetuning_type": "full", "use_reentrant_gc": False},
    "lora-default": {"finetuning_type": "lora", "lora_target": "all"},
    "lora-non-reentrant": {"finetuning_type": "lora", "lora_target": "all", "use_reentrant_gc": False},
    "freeze-default": {"finetuning_type": "freeze"},
    # the Trainer's own flag besides LLaMA-Factory's checkpointing, no kwargs: the Trainer re-enables over it
    "freeze-trainer-gc": {"finetuning_type": "freeze", "gradient_checkpointing": True},
    "lora-trainer-gc": {"finetuning_type": "lora", "lora_target": "all", "gradient_checkpointing": True},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from trl_gc_plugin.testing import CORPUS, make_model, make_tokenizer

    root = tmp_path_factory.mktemp("llamafactory")
    make_model().save_pretrained(root / "model")
    make_tokenizer().save_pretrained(root / "model")
    data = root / "data"
    data.mkdir()
    rows = [{"instruction": c.split()[0], "input": "", "output": " ".join(c.split()[1:])} for c in CORPUS]
    (data / "tiny.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    return root


def _yaml(root: Path, name: str, extra: dict) -> Path:
    values = {
        "model_name_or_path": str(root / "model"),
        "stage": "sft",
        "do_train": True,
        "dataset": "tiny",
        "dataset_dir": str(root / "data"),
        "template": "default",
        "cutoff_len": 32,
        "overwrite_cache": True,
        "output_dir": str(root / f"out-{name}"),
        "overwrite_output_dir": True,
        "report_to": "none",
        "max_steps": 2,
        "per_device_train_batch_size": 2,
        "logging_steps": 1,
        "save_strategy": "no",
        "use_cpu": True,
        **extra,
    }
    path = root / f"{name}.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in values.items()))
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_llamafactory_cli_train_agrees_with_the_check(workspace, name):
    config = _yaml(workspace, name, CASES[name])
    env = {**os.environ, "TRL_GC_PLUGIN": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([CLI, "train", str(config)], env=env, capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "train_loss" in log
    lines = [line for line in log.splitlines() if line.startswith("[trl_gc_plugin]")]
    assert lines, log[-4000:]
    decisions = json.loads((workspace / f"out-{name}" / "gc_decisions.json").read_text())
    assert not [d for d in decisions if d["action"] == "error"]
    false_alarms = {"model-kwargs-stale", "checkpointing-unasked", "frozen-inputs-observed"}
    assert not [d for d in decisions if d["rule_id"] in false_alarms and d["action"] != "none"], decisions

    check = subprocess.run([*CHECK, str(config)], capture_output=True, text=True, timeout=600)
    report = json.loads(check.stdout)[0]
    assert report["exit_code"] == 0 and report["status"] == "ok", report
    expected = report["facts"]["use_reentrant"]
    assert f"use_reentrant={expected!r}" in lines[-1], (lines[-1], expected)

    def verdicts(records):
        return sorted({(d["rule_id"], d["action"]) for d in records if d["action"] not in ("none", "default")})

    ran = [d for d in decisions if d["setting"] == "use_reentrant" and d.get("stage") != "runtime"]
    checked = [d for d in report["decisions"] if d["setting"] == "use_reentrant"]
    assert verdicts(ran) == verdicts(checked), (ran, checked)
