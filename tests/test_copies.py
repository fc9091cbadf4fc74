"""Nothing of the plugin on copies of the model: a user callback that deep-copies or pickles the model at any event
of the first step (an EMA model, a reference model, a whole-model save) gets what it gets without the plugin."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from trainers import make_trainer
from transformers import TrainerCallback

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model import ckpt
from trl_gc_plugin.model import hooks as _hooks
from trl_gc_plugin.model.hooks import Hooks
from trl_gc_plugin.testing import make_model

EVENTS = ("on_train_begin", "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end")


def hooks(model):
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(getattr(m, "_backward_hooks", {})) for m in model.modules()
    )


class Copier(TrainerCallback):
    """At each event of the first step: the hooks a deep copy carries, and whether a pickle names the plugin."""

    def __init__(self):
        self.seen = {}

    def _look(self, event, model):
        if event in self.seen or model is None:
            return
        copied = copy.deepcopy(model)
        try:
            blob = pickle.dumps(model)
        except Exception as exc:  # transformers 5's input-require-grad hook is a local function: not picklable at all
            blob = type(exc).__name__.encode()
        self.seen[event] = (hooks(copied), b"trl_gc_plugin" in blob, sorted(copied.__dict__.keys()))


for _event in EVENTS:
    setattr(Copier, _event, lambda self, args, state, control, model=None, _e=_event, **kw: self._look(_e, model))


@pytest.mark.parametrize("budget", [None, "1TiB"], ids=["no-plan", "plan"])  # a plan waits for the first forward
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_copy_at_any_first_step_event_equals_the_plugin_free_copy(reentrant, budget, tmp_path):
    outcomes = {}
    for plugin in (False, True):
        torch.manual_seed(0)
        copier = Copier()
        callbacks = ([SafeGCCallback(parity_check=True, memory_budget=budget)] if plugin else []) + [copier]
        make_trainer("trainer", make_model(), str(tmp_path / str(plugin)), gc_kwargs={"use_reentrant": reentrant},
                     callbacks=callbacks, max_steps=2).train()
        assert set(copier.seen) == set(EVENTS)
        outcomes[plugin] = copier.seen
    assert outcomes[True] == outcomes[False]
    assert not any(named for _, named, _ in outcomes[True].values())
    assert _hooks.waiting() == 0


def test_a_copy_of_a_guarded_model_enables_its_own_checkpointing_and_nothing_stays_on_the_class():
    """The enable guard (kept layer pattern across TRL's re-enables) lives on the class and dispatches by identity:
    a deep copy made while it is installed carries nothing of it, and enabling the copy changes the copy only."""
    from trl_gc_plugin.model import probe
    from trl_gc_plugin.model.enable_guard import EnableGuard

    model = make_model(num_hidden_layers=4)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for block, on in zip(ckpt.blocks(model), (True, False, True, False), strict=True):
        block.gradient_checkpointing = on
    guard, run_hooks = EnableGuard(model, frozenset()), Hooks()
    guard.install(run_hooks)
    assert "gradient_checkpointing_enable" not in vars(model)
    twin = copy.deepcopy(model)
    assert "gradient_checkpointing_enable" not in vars(twin)  # it was the guard's closure, bound to `model`
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert probe.block_pattern(model) == (True, False, True, False)  # the guard put the pattern back
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert probe.block_pattern(twin) == (True,) * 4  # the copy's own enable, not the original's
    run_hooks.remove()
    assert "gradient_checkpointing_enable" not in vars(type(model))


def test_a_keyword_pre_hook_outside_the_module_sees_the_keywords_and_leaves_nothing():
    """The plan's first-forward hook needs the call's keywords (Trainer calls `model(**inputs)`): a process-wide
    pre-hook gets them for the chosen module only; a copy made meanwhile is not called back; removal leaves no key."""
    model = make_model(num_hidden_layers=1)
    seen = []
    handle = Hooks().forward_pre_with_kwargs(model, lambda m, a, k: seen.append((m, sorted(k))))
    assert handle is not None  # torch 2.13 passes the keywords to a flagged process-wide hook
    twin = copy.deepcopy(model)
    ids = torch.tensor([[1, 2, 3]])
    model(input_ids=ids)
    twin(input_ids=ids)
    assert [(m is model, keys) for m, keys in seen] == [(True, ["input_ids"])]
    assert hooks(twin) == hooks(make_model(num_hidden_layers=1))
    handle.remove()
    handle.remove()  # idempotent
    assert _hooks.waiting() == 0 and not model._forward_pre_hooks_with_kwargs
    model(input_ids=ids)
    assert len(seen) == 1
