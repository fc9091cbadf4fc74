"""transformers >= 5.23: `activation_checkpointing*` are the real fields, `gradient_checkpointing*` deprecated aliases."""

from __future__ import annotations

import pytest
from trainers import HAS_ACTIVATION_FIELDS, common_args
from transformers import TrainingArguments

import trl_gc_plugin
from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

pytestmark = pytest.mark.skipif(not HAS_ACTIVATION_FIELDS, reason="needs transformers >= 5.23")


def _train(args, callbacks=None):
    from transformers import Trainer

    model = make_model()
    trainer = Trainer(model=model, args=args, train_dataset=tokenized_dataset(make_tokenizer()), callbacks=callbacks)
    trainer.train()
    return trainer, model


def _trl_style_write(args):
    """What TRL 1.16 does for PEFT + DeepSpeed ZeRO-3 (sft_trainer.py, grpo_trainer.py ...)."""
    args.gradient_checkpointing_kwargs = args.gradient_checkpointing_kwargs or {}
    args.gradient_checkpointing_kwargs["use_reentrant"] = True


def test_upstream_ignores_a_later_write_to_the_deprecated_name(tmp_path):
    args = TrainingArguments(**common_args(str(tmp_path), activation_checkpointing=True))
    _trl_style_write(args)
    assert args.activation_checkpointing_kwargs is None  # the write went to the old name only
    _, model = _train(args)
    assert model_use_reentrant(model) is False  # TRL asked for reentrant; the model runs non-reentrant


def test_callback_reconciles_the_two_names(tmp_path, plugin_log):
    args = TrainingArguments(**common_args(str(tmp_path), activation_checkpointing=True))
    _trl_style_write(args)
    callback = SafeGCCallback()
    _, model = _train(args, [callback])
    assert args.activation_checkpointing_kwargs is args.gradient_checkpointing_kwargs
    assert args.activation_checkpointing_kwargs["use_reentrant"] is True
    assert model_use_reentrant(model) is True  # what was asked for last now runs
    repair = [d for d in callback.decisions if d.rule_id == "field-disagreement"]
    assert repair and repair[0].action == "repair" and repair[0].after is True
    assert "[field-disagreement] repair" in plugin_log.text


def test_with_install_the_shared_dict_makes_the_trl_write_reach_both_names(tmp_path):
    with trl_gc_plugin.installed(callback=False):
        args = TrainingArguments(**common_args(str(tmp_path), activation_checkpointing=True))
    _trl_style_write(args)  # `kwargs or {}` returns the plugin's shared dict: an in-place write
    assert args.activation_checkpointing_kwargs["use_reentrant"] is True
    callback = SafeGCCallback()
    _, model = _train(args, [callback])
    decided = [d for d in callback.decisions if d.setting == "use_reentrant" and d.stage == "init_end"][0]
    assert decided.source == "trainer" and decided.action == "warn" and decided.after is True
    assert model_use_reentrant(model) is True


def test_a_later_write_to_the_new_name_wins(tmp_path):
    with trl_gc_plugin.installed(callback=False):
        args = TrainingArguments(**common_args(str(tmp_path), activation_checkpointing=True))
    args.activation_checkpointing_kwargs = {"use_reentrant": True}
    callback = SafeGCCallback()
    _, model = _train(args, [callback])
    assert args.gradient_checkpointing_kwargs is args.activation_checkpointing_kwargs
    assert [d for d in callback.decisions if d.rule_id == "field-disagreement"][0].setting == (
        "gradient_checkpointing_kwargs")
    assert model_use_reentrant(model) is True


def test_switching_off_through_the_deprecated_name(tmp_path):
    args = TrainingArguments(**common_args(str(tmp_path), activation_checkpointing=True))
    args.gradient_checkpointing = False  # what TRL <= 0.26 does after preparing a QLoRA model itself
    _, bare = _train(args)
    assert model_use_reentrant(bare) is False  # upstream ignores the switch-off: checkpointing is on anyway

    args = TrainingArguments(**common_args(str(tmp_path), activation_checkpointing=True))
    args.gradient_checkpointing = False
    _, model = _train(args, [SafeGCCallback()])
    assert args.activation_checkpointing is False and model_use_reentrant(model) is None
