"""DeepSpeed: ZeRO facts read from real arguments, and real ZeRO-3 training on CPU (`DS_ACCELERATOR=cpu`).

The first run compiles DeepSpeed's CPU ops (30-60 s; cached under TORCH_EXTENSIONS_DIR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from torchrun import free_port
from trainers import HAS_ACTIVATION_FIELDS, common_args

from trl_gc_plugin.model import probe

ZERO3 = {"zero_optimization": {"stage": 3}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto"}


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.mark.parametrize("given", ["dict", "json_path"])
def test_zero_stage_from_the_arguments(given, tmp_path):
    from transformers import TrainingArguments

    config = ZERO3
    if given == "json_path":
        config = str(tmp_path / "ds.json")
        Path(config).write_text(json.dumps(ZERO3))
    args = TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True, deepspeed=config, use_cpu=False))
    assert probe.zero_stage(args) == 3
    assert probe.facts_from_args(args).zero_stage == 3


def test_zero_stage_from_accelerates_environment(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    args = TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True))
    assert probe.zero_stage(args) is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert probe.zero_stage(args) == 3
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    assert probe.zero_stage(args) == 2


@pytest.fixture(scope="module")
def sft_zero3_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds")
    script = Path(__file__).with_name("ds_scenarios.py")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                           str(free_port()), str(script), str(out), "none", "strict"],
                          capture_output=True, text=True, timeout=900, env=env)
    results = {json.loads(line)["plugin"]: json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()}
    assert proc.returncode == 0 and set(results) == {"none", "strict"}, proc.stderr[-4000:]
    return results


def test_trl_peft_zero3_field_bug_and_its_repair(sft_zero3_results):
    """TRL 1.16 forces use_reentrant=True for PEFT + ZeRO-3 by assigning a new dict to the deprecated field; on
    transformers >= 5.23 the Trainer never sees it. The plugin reconciles the two names."""
    bare, fixed = sft_zero3_results["none"], sft_zero3_results["strict"]
    assert bare["zero_stage"] == fixed["zero_stage"] == 3
    assert bare["outcome"] == fixed["outcome"] == "trained"
    assert fixed["lora_changed"] == fixed["lora_total"] == 8
    assert bare["gradient_checkpointing_kwargs"] == {"use_reentrant": True}  # TRL's intent
    if HAS_ACTIVATION_FIELDS:
        assert bare["activation_checkpointing_kwargs"] is None and bare["running"] is False  # ... lost upstream
        assert ["field-disagreement", "repair", "True"] in fixed["decisions"]
    assert fixed["activation_checkpointing_kwargs"] in ({"use_reentrant": True}, "n/a")
    assert fixed["running"] is True  # what TRL asked for now runs
    # DeepSpeed >= 0.19.3 has the recompute fix: the old-DeepSpeed rule does not apply here
    assert not [d for d in fixed["decisions"] if d[0] == "zero3-frozen-needs-reentrant"]


def test_deepspeeds_activation_checkpointing_block_does_nothing_here(sft_zero3_results):
    """The config asks DeepSpeed to partition and offload activations; DeepSpeed never configures its checkpointing
    for a Hugging Face model (transformers checkpoints through torch), with or without the plugin, which says so."""
    for result in sft_zero3_results.values():
        assert result["deepspeed_checkpointing_configured"] is False
    said = [d for d in sft_zero3_results["strict"]["decisions"] if d[0] == "deepspeed-activation-checkpointing-ignored"]
    assert said and said[0][1] == "warn"
