"""Runtime verification on real trainers: gradient audit, drift repair, hook pile-up, parity probe."""

from __future__ import annotations

import pytest
import torch
from trainers import TF5, block_params, make_trainer, unchanged_block_params
from transformers import TrainerCallback

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.model.probe import input_grad_hooks
from trl_gc_plugin.testing import make_model


def detached_embeddings():
    """Trainable embeddings whose output a user hook detaches: no static rule can see that the layers' inputs will
    not require grad."""
    model = make_model()
    model.get_input_embeddings().register_forward_hook(lambda module, inputs, output: output.detach())
    return model


def frozen_embeddings():
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def verdicts(callback, rule_id):
    return [d for d in callback.decisions if d.rule_id == rule_id]


def test_audit_passes_on_a_correct_run(tmp_path):
    callback = SafeGCCallback()
    make_trainer("trainer", make_model(), str(tmp_path), callbacks=[callback]).train()
    (audit,) = verdicts(callback, "gradient-audit")
    assert audit.action == "none" and audit.before == 2  # both decoder layers checked


@pytest.mark.skipif(TF5, reason="transformers 5 hooks the inputs itself; reentrant works there")
def test_audit_catches_the_real_failure_in_warn_mode(tmp_path, plugin_log):
    callback = SafeGCCallback(mode="warn")
    trainer = make_trainer("trainer", frozen_embeddings(), str(tmp_path), gc_kwargs={"use_reentrant": True},
                           callbacks=[callback])
    before = block_params(trainer.model)
    trainer.train()
    (audit,) = verdicts(callback, "gradient-audit")
    assert audit.action == "warn" and "2 of 2 checkpointed block(s)" in audit.reason
    assert "model.layers.0" in audit.reason and "use_reentrant=True" in audit.reason
    assert "audit=False" in audit.reason
    assert len(unchanged_block_params(trainer.model, before)) == len(before)  # warn mode changed nothing
    assert "[gradient-audit] warn" in plugin_log.text
    # the first forward saw it first, once per block stack
    assert [d.action for d in verdicts(callback, "frozen-inputs-observed")] == ["warn"]


def test_the_first_forward_catches_what_no_static_rule_sees(tmp_path):
    callback = SafeGCCallback()
    trainer = make_trainer("trainer", detached_embeddings(), str(tmp_path), gc_kwargs={"use_reentrant": True},
                           callbacks=[callback])
    # the static rules see trainable embeddings and let reentrant through
    assert not [d for d in callback.decisions if d.action == "error"]
    before = block_params(trainer.model)
    if TF5:  # transformers' own input hook runs after the user's and re-enables grad: it trains
        trainer.train()
        assert unchanged_block_params(trainer.model, before) == []
        assert verdicts(callback, "gradient-audit")[0].action == "none"
        assert verdicts(callback, "frozen-inputs-observed") == []
        return
    with pytest.raises(GCConfigError, match="frozen-inputs-observed") as err:
        trainer.train()
    assert "model.layers.0 ran with use_reentrant=True" in str(err.value)
    assert len(unchanged_block_params(trainer.model, before)) == len(before)  # raised in the first forward


@pytest.mark.skipif(TF5, reason="nothing to fix on transformers 5")
def test_fix_mode_repairs_the_first_step_and_switches_to_non_reentrant(tmp_path):
    callback = SafeGCCallback(mode="fix")
    trainer = make_trainer("trainer", detached_embeddings(), str(tmp_path), gc_kwargs={"use_reentrant": True},
                           callbacks=[callback], max_steps=1)
    before = block_params(trainer.model)
    trainer.train()
    (seen,) = verdicts(callback, "frozen-inputs-observed")
    assert seen.action == "override" and seen.after is False
    assert verdicts(callback, "gradient-audit")[0].action == "none"  # the repaired first step trained every block
    assert unchanged_block_params(trainer.model, before) == []
    assert model_use_reentrant(trainer.model) is False
    assert trainer.args.gradient_checkpointing_kwargs["use_reentrant"] is False


def test_an_unused_trainable_module_in_a_block_does_not_trip_the_audit(tmp_path):
    model = make_model()
    model.model.layers[0].unused_expert = torch.nn.Linear(64, 64)  # trainable, never called
    callback = SafeGCCallback()
    make_trainer("trainer", model, str(tmp_path), callbacks=[callback]).train()
    assert model.model.layers[0].unused_expert.weight.grad is None
    assert verdicts(callback, "gradient-audit")[0].action == "none"


@pytest.mark.parametrize("how", ["argument", "env"])
def test_audit_can_be_switched_off(how, tmp_path, monkeypatch):
    if how == "env":
        monkeypatch.setenv("TRL_GC_PLUGIN_AUDIT", "0")
        callback = SafeGCCallback()
    else:
        callback = SafeGCCallback(audit=False)
    make_trainer("trainer", make_model(), str(tmp_path), callbacks=[callback]).train()
    assert verdicts(callback, "gradient-audit") == []


class ReenableWithOtherKwargs(TrainerCallback):
    """Something (a user callback, a trainer) re-enables checkpointing mid-training with the other mode."""

    def __init__(self, touch_args: bool):
        self.touch_args = touch_args
        self.flipped_to = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.flipped_to = not model_use_reentrant(model)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": self.flipped_to})
            if self.touch_args:
                args.gradient_checkpointing_kwargs = {"use_reentrant": self.flipped_to}


@pytest.mark.parametrize("touch_args", [False, True])
def test_drift_is_detected_and_repaired_once(touch_args, tmp_path, plugin_log):
    callback = SafeGCCallback()
    trainer = make_trainer("trainer", make_model(), str(tmp_path), max_steps=4,
                           callbacks=[ReenableWithOtherKwargs(touch_args), callback])
    trainer.train()
    drift = verdicts(callback, "checkpointing-drift")
    settings = {d.setting for d in drift}
    assert "model.use_reentrant" in settings
    # on transformers >= 5.23 a write to the deprecated name shows as the two names parting
    assert bool(settings & {"use_reentrant", "gradient_checkpointing_kwargs"}) is touch_args
    assert all(d.action == "repair" and d.after is False for d in drift)
    assert [d.before for d in drift if d.setting == "model.use_reentrant"] == [True]
    assert model_use_reentrant(trainer.model) is False
    assert trainer.args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    if hasattr(trainer.args, "activation_checkpointing_kwargs"):
        assert trainer.args.activation_checkpointing_kwargs is trainer.args.gradient_checkpointing_kwargs


def test_drift_in_warn_mode_is_only_logged(tmp_path):
    callback, drifter = SafeGCCallback(mode="warn"), ReenableWithOtherKwargs(False)
    trainer = make_trainer("trainer", make_model(), str(tmp_path), max_steps=3, callbacks=[drifter, callback])
    trainer.train()
    (drift,) = verdicts(callback, "checkpointing-drift")
    assert drift.action == "warn" and not drift.applied and drift.before is drifter.flipped_to
    assert model_use_reentrant(trainer.model) is drifter.flipped_to


class HookCounter(TrainerCallback):
    def __init__(self):
        self.counts = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.counts.append(input_grad_hooks(model))


@pytest.mark.parametrize("with_plugin", [False, True])
def test_input_hooks_do_not_pile_up_over_grpo_steps(with_plugin, tmp_path):
    counter = HookCounter()
    callbacks = ([SafeGCCallback()] if with_plugin else []) + [counter]
    make_trainer("grpo", make_model(), str(tmp_path), max_steps=4, callbacks=callbacks).train()
    if with_plugin:
        assert counter.counts == [1] * 4 if TF5 else counter.counts == [0] * 4
    elif TF5:  # pin the upstream behaviour: every re-enable adds one more hook
        assert counter.counts == sorted(counter.counts) and counter.counts[-1] > counter.counts[0] > 1
    else:  # transformers 4 adds no hook for a full model
        assert counter.counts == [0] * 4


def test_parity_probe_on_a_correct_run(tmp_path):
    callback = SafeGCCallback(parity_check=True)
    make_trainer("trainer", frozen_embeddings(), str(tmp_path), callbacks=[callback]).train()
    (parity,) = verdicts(callback, "parity-check")
    assert parity.action == "none" and parity.after["compared"] == 18 + 1 + 1  # layers, final norm, lm_head
    assert parity.after["max_abs"] <= 1e-6


@pytest.mark.skipif(TF5, reason="transformers 5 hooks the inputs itself; reentrant works there")
def test_parity_probe_reports_gradients_lost_to_checkpointing(tmp_path):
    callback = SafeGCCallback(mode="warn", parity_check=True, audit=False)
    make_trainer("trainer", frozen_embeddings(), str(tmp_path), gc_kwargs={"use_reentrant": True},
                 callbacks=[callback]).train()
    (parity,) = verdicts(callback, "parity-check")
    assert parity.action == "warn" and "get a gradient only without checkpointing" in parity.reason
