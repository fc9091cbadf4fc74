"""Rule `activation-offloading-needs-accelerator` (issue 26, item 9): TRL's `activation_offloading=True` on a
machine without an accelerator stops `SFTTrainer.__init__` with an `AttributeError`, before any callback runs. The
post-init route (`install()`, `TRL_GC_PLUGIN=1`) says it when the config is built (strict) or switches offloading
off (fix)."""

from __future__ import annotations

import pytest
import torch
from trainers import make_trainer

import trl_gc_plugin
from trl_gc_plugin import GCConfigError
from trl_gc_plugin.model import probe
from trl_gc_plugin.testing import make_model

trl = pytest.importorskip("trl")
if "activation_offloading" not in {f.name for f in __import__("dataclasses").fields(trl.SFTConfig)}:
    pytest.skip("this TRL has no activation_offloading", allow_module_level=True)
if probe.accelerator_usable():
    pytest.skip("an accelerator is present: TRL's offloading runs", allow_module_level=True)


def test_without_the_plugin_the_trainer_fails_to_build(tmp_path):
    # A CPU build has no accelerator at all (`current_accelerator()` is None); a CUDA build without a GPU names CUDA,
    # and TRL's stream then fails to initialise the driver.
    error, message = (RuntimeError, "CUDA") if probe.accelerator_built() else (AttributeError, "'type'")
    with pytest.raises(error, match=message):
        make_trainer("sft", make_model(), str(tmp_path), activation_offloading=True)


def test_strict_refuses_when_the_config_is_built(tmp_path):
    with trl_gc_plugin.installed(mode="strict"), pytest.raises(GCConfigError) as info:
        make_trainer("sft", make_model(), str(tmp_path), activation_offloading=True)
    assert "[activation-offloading-needs-accelerator]" in str(info.value)


def test_fix_switches_offloading_off_and_trains(tmp_path):
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with trl_gc_plugin.installed(mode="fix"):
        trainer = make_trainer("sft", model, str(tmp_path), activation_offloading=True, max_steps=1)
        assert trainer.args.activation_offloading is False
        trainer.train()
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_offloading_off_gets_no_such_decision(tmp_path):
    with trl_gc_plugin.installed(mode="strict"):
        trainer = make_trainer("sft", make_model(), str(tmp_path), max_steps=1)
    record = probe.get_record(trainer.args)
    assert record is not None
    assert not [d for d in record.decisions if d.rule_id == "activation-offloading-needs-accelerator"]
