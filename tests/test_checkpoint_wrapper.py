"""Rule `checkpoint-wrapper-zero3-saved-keys` (issue 26, item 9, axolotl #3166): blocks wrapped by torch's
`checkpoint_wrapper` (Axolotl's activation offloading on a full fine-tune) under DeepSpeed ZeRO-3 save weights whose
keys hold `_checkpoint_wrapped_module`, which `from_pretrained` does not load. Reproduced for real on CPU (ZeRO-3,
torchrun, one process); the plugin says it, at the run and in `trl-gc-check`, and changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from torchrun import free_port

from trl_gc_plugin.configcheck.check import Launch, check_files

RULE = "checkpoint-wrapper-zero3-saved-keys"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("wrapper")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    scenarios = ["zero3-none", "zero3-strict", "plain-strict"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                           str(free_port()), str(Path(__file__).with_name("wrapper_scenarios.py")), str(out),
                           *scenarios], capture_output=True, text=True, timeout=900, env=env)
    lines = (out / "results.jsonl").read_text().splitlines() if (out / "results.jsonl").exists() else []
    by = {json.loads(line)["scenario"]: json.loads(line) for line in lines}
    assert proc.returncode == 0 and set(by) == set(scenarios), proc.stderr[-4000:]
    return by


def test_zero3_saves_wrapped_keys_without_the_plugin_and_the_plugin_says_so(results):
    bare, plugged, plain = results["zero3-none"], results["zero3-strict"], results["plain-strict"]
    assert bare["outcome"] == "trained" and bare["wrapped_keys"] > 0  # the failure, silent
    assert plain["outcome"] == "trained" and plain["wrapped_keys"] == 0  # torch strips the prefix from state_dict
    assert plugged["outcome"] == "trained"  # never refused
    assert plugged["wrapped_keys"] == bare["wrapped_keys"]  # the plugin changes nothing
    assert [d[1:] for d in plugged["decisions"] if d[0] == RULE] == [["warn", "warning"]]
    assert not [d for d in plain["decisions"] if d[0] == RULE]


@pytest.mark.parametrize(("extra", "said"), [
    ("activation_offloading: true\ndeepspeed: deepspeed_configs/zero3_bf16.json\n", True),
    ("activation_offloading: disk\ndeepspeed: deepspeed_configs/zero3_bf16.json\n", True),
    ("activation_offloading: true\nadapter: lora\ndeepspeed: deepspeed_configs/zero3_bf16.json\n", False),  # no wrap
    ("activation_offloading: true\ndeepspeed: deepspeed_configs/zero2.json\n", False),
    ("activation_offloading: true\n", False),
])
def test_the_check_says_it_for_axolotls_offloading_under_zero3(tmp_path, extra, said):
    path = tmp_path / "ax.yml"
    path.write_text("base_model: NousResearch/Llama-3.2-1B\ngradient_checkpointing: true\n" + extra)
    (report,) = check_files([str(path)], Launch(parser="model", nproc=2))
    assert report.status != "error", report.error
    found = [(d.action, d.level) for d in report.decisions if d.rule_id == RULE]
    assert found == ([("warn", "warning")] if said else [])
