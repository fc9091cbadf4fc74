"""Checkpointing enabled on the model before the Trainer runs (TRL <= 0.26, PEFT's kbit prep, user code)."""

from __future__ import annotations

import pytest
from trainers import TF5, block_params, make_trainer, unchanged_block_params
from transformers import TrainerCallback

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model.ckpt import functions as checkpoint_functions
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.model.probe import input_grad_hooks
from trl_gc_plugin.testing import make_model


def prepared_elsewhere():
    """Frozen embeddings, checkpointing switched on by hand in reentrant mode, args that leave it alone."""
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model


def test_without_plugin(tmp_path):
    trainer = make_trainer("trainer", prepared_elsewhere(), str(tmp_path), gc=False)
    before = block_params(trainer.model)
    trainer.train()
    untrained = unchanged_block_params(trainer.model, before)
    if TF5:  # 5.x's enable added the input-grad hook itself: reentrant works
        assert untrained == []
    else:
        assert len(untrained) == len(before)


def test_plugin_rewrites_the_live_checkpoint_function(tmp_path):
    model = prepared_elsewhere()
    hooks = input_grad_hooks(model)
    callback = SafeGCCallback()
    trainer = make_trainer("trainer", model, str(tmp_path), gc=False, callbacks=[callback])
    if not TF5:
        stale = [d for d in callback.decisions if d.rule_id == "model-kwargs-stale"]
        assert stale and stale[0].before is True and stale[0].after is False
        assert model_use_reentrant(model) is False
        assert all(f.keywords["use_reentrant"] is False for _, f in checkpoint_functions(model))
    assert input_grad_hooks(model) == hooks  # rewritten in place, no hook added
    before = block_params(trainer.model)
    trainer.train()
    assert unchanged_block_params(trainer.model, before) == []


@pytest.mark.parametrize("mode", ["fix", "warn"])
def test_modes_on_a_real_trainer(mode, tmp_path):
    if TF5:
        pytest.skip("nothing breaks on transformers 5")
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    callback = SafeGCCallback(mode=mode)
    trainer = make_trainer("trainer", model, str(tmp_path), gc_kwargs={"use_reentrant": True}, callbacks=[callback])
    before = block_params(trainer.model)
    trainer.train()
    untrained = unchanged_block_params(trainer.model, before)
    # the final norm is trainable, so the static facts are not certain: the first forward settles it
    decision = [d for d in callback.decisions if d.rule_id == "frozen-inputs-observed"][0]
    if mode == "fix":
        assert decision.action == "override" and untrained == []
        assert trainer.args.gradient_checkpointing_kwargs["use_reentrant"] is False
    else:  # warn: nothing changed, and the failure happens as it would without the plugin
        assert decision.action == "warn" and len(untrained) == len(before)
        assert trainer.args.gradient_checkpointing_kwargs["use_reentrant"] is True


class RecordUseCache(TrainerCallback):
    """Records `model.config.use_cache` as every training forward sees it."""

    def __init__(self, model):
        self.seen = []
        model.register_forward_pre_hook(lambda module, args: self.seen.append(module.config.use_cache))


def test_use_cache_is_off_while_training_and_as_the_trainer_leaves_it_otherwise(tmp_path):
    bare_model = make_model()
    make_trainer("trainer", bare_model, str(tmp_path / "bare")).train()
    model = make_model()
    recorder = RecordUseCache(model)
    trainer = make_trainer("trainer", model, str(tmp_path / "plugin"), callbacks=[SafeGCCallback()])
    # transformers >= 5 writes args.use_cache (False) into the top-level config itself; 4.x leaves it alone
    assert model.config.use_cache is (not TF5)
    trainer.train()
    assert recorder.seen and not any(recorder.seen)  # every training forward ran without a cache
    assert model.config.use_cache is bare_model.config.use_cache  # afterwards: as without the plugin
