"""Rule `model-cannot-checkpoint` (issue 26, item 8): a model class with `supports_gradient_checkpointing = False`
(NemotronH before transformers PR 45625) makes `Trainer.train()` raise transformers' ValueError when it enables
checkpointing. Without the plugin that error comes at `train()`; with it, strict mode says so when the Trainer is
built, naming the setting; fix mode trains without checkpointing; warn mode changes nothing."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model
from trainers import lora_config, make_trainer
from transformers import LlamaForCausalLM

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.testing import make_config


class NoCheckpointingLlama(LlamaForCausalLM):
    supports_gradient_checkpointing = False


def make(variant: str):
    torch.manual_seed(0)
    model = NoCheckpointingLlama(make_config())
    return get_peft_model(model, lora_config()) if variant == "lora" else model


def trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def rule_decisions(callback):
    return [d for d in callback.decisions if d.rule_id == "model-cannot-checkpoint"]


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_without_the_plugin_train_raises_transformers_value_error(variant, tmp_path):
    model = make(variant)
    before = trainable(model)
    trainer = make_trainer("trainer", model, str(tmp_path))
    with pytest.raises(ValueError, match=r"does not support (gradient|activation) checkpointing"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in trainable(model).items())


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_strict_refuses_when_the_trainer_is_built_naming_the_setting(variant, tmp_path):
    with pytest.raises(GCConfigError) as info:
        make_trainer("trainer", make(variant), str(tmp_path), callbacks=[SafeGCCallback()])
    message = str(info.value)
    assert "[model-cannot-checkpoint]" in message and "gradient_checkpointing=False" in message
    assert "supports_gradient_checkpointing" in message


def test_fix_trains_without_checkpointing(tmp_path):
    model = make("full")
    before = trainable(model)
    callback = SafeGCCallback(mode="fix")
    trainer = make_trainer("trainer", model, str(tmp_path), callbacks=[callback])
    trainer.train()
    (decision,) = rule_decisions(callback)
    assert decision.action == "override" and decision.after is False
    assert not trainer.args.gradient_checkpointing
    assert all(not torch.equal(p, before[n]) for n, p in trainable(model).items())


def test_warn_changes_nothing(tmp_path):
    callback = SafeGCCallback(mode="warn")
    trainer = make_trainer("trainer", make("full"), str(tmp_path), callbacks=[callback])
    assert [d.action for d in rule_decisions(callback)] == ["warn"]
    with pytest.raises(ValueError, match=r"does not support (gradient|activation) checkpointing"):
        trainer.train()


def test_a_model_that_supports_checkpointing_gets_no_such_decision(tmp_path):
    torch.manual_seed(0)
    callback = SafeGCCallback()
    make_trainer("trainer", LlamaForCausalLM(make_config()), str(tmp_path), callbacks=[callback], max_steps=1).train()
    assert not rule_decisions(callback)
