"""The real TRL CLI with `TRL_GC_PLUGIN=1` (issue 25): `trl sft --config cfg.yaml` on a tiny local model and a local
JSON-lines dataset, CPU, two steps. TRL parses the config in the launching process and trains in the process
`accelerate launch` starts: the plugin's lines appear once, the decisions file is written, a refusal reads as one
message (no traceback) and stops the launch before the child starts, and `trl-gc-check` on the same file says what
the run did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_gc_plugin.testing import CORPUS, make_model, make_tokenizer

TRL = Path(sys.executable).with_name("trl")
pytestmark = pytest.mark.skipif(not TRL.exists(), reason="the trl command is not installed next to this Python")

CONFIG = """\
model_name_or_path: {model}
dataset_name: {data}
output_dir: {out}
max_steps: 2
per_device_train_batch_size: 2
report_to: none
use_cpu: true
bf16: false
save_strategy: "no"
gradient_checkpointing: true
gradient_checkpointing_kwargs: {kwargs}
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-cli")
    make_model().save_pretrained(root / "model")
    make_tokenizer().save_pretrained(root / "model")
    (root / "data").mkdir()
    with open(root / "data" / "train.jsonl", "w", encoding="utf-8") as fh:
        for text in CORPUS * 4:
            fh.write(json.dumps({"text": text}) + "\n")
    return root


def run(workspace: Path, name: str, kwargs: str, **env: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out = workspace / name
    config = workspace / f"{name}.yaml"
    config.write_text(CONFIG.format(model=workspace / "model", data=workspace / "data", out=out, kwargs=kwargs))
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TRL_GC_PLUGIN", "_TRL_GC_PLUGIN"))}
    environ.update(TRL_GC_PLUGIN="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", **env)
    proc = subprocess.run([str(TRL), "sft", "--config", str(config)], capture_output=True, text=True, env=environ,
                          timeout=600, cwd=workspace)
    return proc, out, config


def check(config: Path, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "trl_gc_plugin", "check", "--json", "--mode", mode, str(config)],
                          capture_output=True, text=True, timeout=300)
    (report,) = json.loads(proc.stdout)
    return report


def test_a_run_says_what_runs_once_and_writes_its_decisions(workspace):
    proc, out, config = run(workspace, "plain", "{use_reentrant: true}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("[trl_gc_plugin] INFO: gradient checkpointing on, use_reentrant=True (yours)") == 1
    decisions = json.loads((out / "gc_decisions.json").read_text())
    assert any(d["rule_id"] == "non-reentrant-default" for d in decisions)
    assert check(config, "strict")["facts"]["use_reentrant"] is True


def test_a_warning_is_said_once_across_the_launch_and_fix_mode_repairs(workspace):
    """An unknown key with reentrant checkpointing crashes torch's first forward; fix mode removes it, and its
    warning is printed once although both the launching process and the training process build the arguments."""
    proc, out, config = run(workspace, "fix", "{use_reentrant: true, preserve_rng: false}", TRL_GC_PLUGIN_MODE="fix")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("[checkpointing-kwargs-unknown-reentrant] override") == 1, proc.stderr[-3000:]
    decisions = json.loads((out / "gc_decisions.json").read_text())
    assert any(d["rule_id"] == "checkpointing-kwargs-unknown-reentrant" and d["action"] == "override"
               for d in decisions)
    report = check(config, "fix")
    assert {d["rule_id"] for d in report["decisions"]} >= {"checkpointing-kwargs-unknown-reentrant"}


def test_a_refusal_is_one_message_and_the_check_refuses_the_same(workspace):
    proc, out, config = run(workspace, "strict", "{use_reentrant: true, preserve_rng: false}")
    assert proc.returncode == 1
    assert "trl_gc_plugin refused this gradient-checkpointing setup" in proc.stderr
    assert "Traceback" not in proc.stderr and "stopped the run before training" in proc.stderr
    assert not (out / "gc_decisions.json").exists()
    report = check(config, "strict")
    assert report["status"] == "refused"
    assert any(d["rule_id"] == "checkpointing-kwargs-unknown-reentrant" and d["action"] == "error"
               for d in report["decisions"])
