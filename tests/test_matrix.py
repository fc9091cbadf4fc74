"""The point of it all: with the plugin, every trainable parameter inside the checkpointed layers trains, on every
trainer x model variant x `use_reentrant` setting; where strict mode refuses a setup, the same setup without the
plugin really does leave block parameters untrained (the refusal is justified, not a guess)."""

from __future__ import annotations

import pytest
from packaging.version import Version
from trainers import (
    TF5,
    TRAINERS,
    TRL_VERSION,
    VARIANTS,
    block_params,
    build_model,
    gc_kwargs_for,
    make_trainer,
    unchanged_block_params,
)

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.model.ckpt import model_use_reentrant


def _grpo_hooks_inputs() -> bool:
    """TRL 0.20's GRPOTrainer enables checkpointing in `__init__` and calls `enable_input_require_grads()` for every
    model when the kwargs are reentrant (read in its `_enable_gradient_checkpointing`); later TRLs do not."""
    import inspect

    from trl import GRPOTrainer

    method = getattr(GRPOTrainer, "_enable_gradient_checkpointing", None)
    return method is not None and "enable_input_require_grads" in inspect.getsource(method)


def _generation_reenables_with_defaults() -> bool:
    """TRL <= 0.26 re-enables checkpointing after generation with no kwargs (`_unwrap_model_for_generation`), that is
    with transformers' default `use_reentrant` (True on 4.x), until GRPO's next re-enable from the args puts the
    decision back; later TRLs pass the args' kwargs."""
    import inspect

    from trl.models import utils

    unwrap = getattr(utils, "_unwrap_model_for_generation", None)
    return unwrap is not None and "gradient_checkpointing_enable()" in inspect.getsource(unwrap)


def _run(kind, variant, use_reentrant, checkpoint, out, callbacks):
    model, peft_config = build_model(variant, kind, checkpoint)
    trainer = make_trainer(kind, model, out, gc_kwargs=gc_kwargs_for(use_reentrant), callbacks=callbacks,
                           peft_config=peft_config)
    before = block_params(trainer.model)
    assert before, "the setup has no trainable parameter inside a checkpointed layer"
    trainer.train()
    return trainer, unchanged_block_params(trainer.model, before)


@pytest.mark.parametrize("use_reentrant", ["unset", True, False])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", TRAINERS)
def test_every_block_parameter_trains(kind, variant, use_reentrant, tiny_checkpoint, tmp_path):
    # Known from the upstream sources: transformers 4.x adds no input-grad hook (5.x does, in train()); TRL adds one
    # for PEFT models; TRL <= 0.26's DPOTrainer adds one for every model; PEFT's prepare_model_for_kbit_training
    # adds none when it does not enable checkpointing itself.
    trl_hooks_full_model = (kind == "dpo" and Version("0.27") > TRL_VERSION) or (kind == "grpo" and _grpo_hooks_inputs())
    expect_refusal = (not TF5 and use_reentrant is True
                      and ((variant == "frozen_emb" and not trl_hooks_full_model)
                           or (variant in ("lora", "qlora") and kind == "trainer")))
    callback = SafeGCCallback()
    try:
        trainer, untrained = _run(kind, variant, use_reentrant, tiny_checkpoint, str(tmp_path / "plugin"), [callback])
    except GCConfigError as err:
        assert expect_refusal, f"unexpected refusal: {err}"
        # strict mode refused an explicit choice: it must be reentrant, and really break training without us
        assert use_reentrant is True, err
        # refused when the arguments meet the model (certain facts) or in the first forward (observed)
        assert err.decisions and err.decisions[0].rule_id in ("frozen-inputs-need-non-reentrant",
                                                              "frozen-inputs-observed")
        try:
            _, untrained = _run(kind, variant, use_reentrant, tiny_checkpoint, str(tmp_path / "bare"), None)
        except RuntimeError as failure:  # LoRA alone: "element 0 of tensors does not require grad"
            assert "does not require grad" in str(failure)
        else:
            assert untrained, "the plugin refused a setup that trains fine without it"
        return

    assert not expect_refusal, "strict mode let through a setup known to break"
    assert untrained == [], f"{len(untrained)} block parameters never changed: {untrained[:4]}"
    decided = [d for d in callback.decisions if d.setting == "use_reentrant"]
    assert decided, callback.decisions
    effective = trainer.args.gradient_checkpointing_kwargs["use_reentrant"]
    if use_reentrant == "unset":
        assert effective is False
        assert decided[-1].action in ("default", "none")
    else:
        assert effective is use_reentrant, "a value the user set was changed"
    assert model_use_reentrant(trainer.model) is effective, "the model ran something other than the decision"
    # runtime verification: the audit ran and passed, nothing drifted; reentrant runs get the parity probe, which
    # finds the gradients equal (or says why it could not run)
    assert [d.action for d in callback.decisions if d.rule_id == "gradient-audit"] == ["none"]
    parity = [d for d in callback.decisions if d.rule_id == "parity-check"]
    assert [d.action for d in parity] == (["none"] if effective else []), parity
    # nothing drifted, except where TRL's generation re-enables with transformers' default: repaired at that re-enable
    drifts = [(d.setting, d.before, d.after, d.action) for d in callback.decisions if d.rule_id == "checkpointing-drift"]
    default = not TF5
    if kind == "grpo" and effective is not default and _generation_reenables_with_defaults():
        assert drifts == [("model.use_reentrant", default, effective, "repair")], drifts
    else:
        assert not drifts, drifts
    if hasattr(trainer.args, "activation_checkpointing_kwargs"):
        assert trainer.args.activation_checkpointing_kwargs is trainer.args.gradient_checkpointing_kwargs
    assert (tmp_path / "plugin" / "gc_decisions.json").exists()
