"""A launcher's own checkpoint function: a `functools.wraps` wrapper around transformers' partial, set on the model
before the Trainer, with the Trainer's own flag off (the pattern LLaMA-Factory uses; the wrapper here is written for
the test). The plugin reads `use_reentrant` behind it, keeps it, and calls nothing unasked or frozen."""

from __future__ import annotations

import functools

import pytest
import torch
from trainers import block_params, make_trainer, unchanged_block_params

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model import ckpt
from trl_gc_plugin.model.ckpt import functions as checkpoint_functions
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.testing import make_model

FALSE_ALARMS = (
    "model-kwargs-stale",
    "checkpointing-unasked",
    "frozen-inputs-observed",
    "frozen-inputs-need-non-reentrant",
)


def launcher_function(use_reentrant: bool):
    """A checkpoint function as a launcher builds it: torch's checkpoint with its kwargs, in a wrapper that makes the
    first floating-point input (the hidden states) require grad before the checkpointed call."""
    partial = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=use_reentrant)

    @functools.wraps(partial)
    def launcher_checkpoint(function, *args, **kwargs):
        for arg in args:
            if torch.is_tensor(arg) and torch.is_floating_point(arg):
                arg.requires_grad_(True)
                break
        return partial(function, *args, **kwargs)

    return launcher_checkpoint


def launcher_prepared(use_reentrant: bool):
    """Frozen input embeddings (freeze tuning), checkpointing enabled on the model by the launcher."""
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=launcher_function(use_reentrant))
    return model


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_ckpt_reads_behind_the_wrapper_and_keeps_it(use_reentrant):
    func = launcher_function(use_reentrant)
    assert ckpt.wrapped(func) and ckpt.inner(func) is func.__wrapped__
    assert ckpt.use_reentrant(func) is use_reentrant
    assert not ckpt.wrapped(torch.utils.checkpoint.checkpoint)  # torch's own decorator is no launcher's wrapper
    rebuilt = ckpt.with_keywords(func, use_reentrant=not use_reentrant)
    assert ckpt.wrapped(rebuilt) and rebuilt.__code__ is func.__code__
    assert ckpt.use_reentrant(rebuilt) is (not use_reentrant)
    assert ckpt.use_reentrant(func) is use_reentrant  # the original is left as it was
    assert ckpt.same(func, launcher_function(use_reentrant)) and not ckpt.same(func, rebuilt)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_launcher_wrapper_is_kept_on_a_real_trainer(use_reentrant, tmp_path):
    model = launcher_prepared(use_reentrant)
    wrappers = {id(m): f for m, f in checkpoint_functions(model)}
    callback = SafeGCCallback()
    trainer = make_trainer("trainer", model, str(tmp_path), gc=False, callbacks=[callback])
    before = block_params(trainer.model)
    trainer.train()
    alarms = [d for d in callback.decisions if d.rule_id in FALSE_ALARMS and d.action != "none"]
    assert alarms == []
    assert not [d for d in callback.decisions if d.action in ("error", "override", "repair")]
    assert model_use_reentrant(model) is use_reentrant
    assert {id(m): f for m, f in checkpoint_functions(model)} == wrappers  # the launcher's functions, untouched
    assert unchanged_block_params(trainer.model, before) == []  # every block trained


def launcher_enable(model):
    """The launcher's own enable method on the model instance (LLaMA-Factory's `_gradient_checkpointing_enable`):
    its wrapper again, with its default `use_reentrant=True` when the caller passes no kwargs."""

    def enable(gradient_checkpointing_kwargs=None, **layer_kwargs):  # transformers >= 5.16 passes every_n_layers
        kwargs = gradient_checkpointing_kwargs or {"use_reentrant": True}
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=launcher_function(kwargs["use_reentrant"]))

    model.gradient_checkpointing_enable = enable
    return model


@pytest.mark.parametrize("own_enable", [True, False])
def test_the_trainers_flag_besides_the_launchers_checkpointing(own_enable, tmp_path):
    """`gradient_checkpointing: true` besides a launcher's own checkpointing, no kwargs, arguments built under
    `install()` (the post-init default writes use_reentrant=False): when the Trainer's re-enable goes through the
    launcher's enable (LLaMA-Factory's), the launcher's value stays in force, as `trl-gc-check` reads it, and nothing is
    called stale; otherwise the Trainer enables with the plugin's default. Every block trains either way."""
    import trl_gc_plugin

    model = launcher_prepared(True)
    if own_enable:
        launcher_enable(model)
    with trl_gc_plugin.installed(callback=False):
        callback = SafeGCCallback()
        trainer = make_trainer("trainer", model, str(tmp_path), gc=True, callbacks=[callback])
    before = block_params(trainer.model)
    trainer.train()
    assert model_use_reentrant(model) is own_enable
    assert all(ckpt.wrapped(f) for _, f in checkpoint_functions(model)) is own_enable
    alarms = [d for d in callback.decisions if d.rule_id in FALSE_ALARMS and d.action not in ("none",)]
    assert alarms == [] if own_enable else all(d.rule_id == "model-kwargs-stale" for d in alarms)
    assert unchanged_block_params(trainer.model, before) == []
