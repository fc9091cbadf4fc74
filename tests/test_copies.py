"""Nothing of the plugin on copies of the model: a user callback that deep-copies or pickles the model at any event
of the first step (an EMA model, a reference model, a whole-model save) gets what it gets without the plugin."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from trainers import make_trainer
from transformers import TrainerCallback

from trl_gc_plugin import SafeGCCallback, _hooks
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


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_copy_at_any_first_step_event_equals_the_plugin_free_copy(reentrant, tmp_path):
    outcomes = {}
    for plugin in (False, True):
        torch.manual_seed(0)
        copier = Copier()
        callbacks = ([SafeGCCallback(parity_check=True)] if plugin else []) + [copier]
        make_trainer("trainer", make_model(), str(tmp_path / str(plugin)), gc_kwargs={"use_reentrant": reentrant},
                     callbacks=callbacks, max_steps=2).train()
        assert set(copier.seen) == set(EVENTS)
        outcomes[plugin] = copier.seen
    assert outcomes[True] == outcomes[False]
    assert not any(named for _, named, _ in outcomes[True].values())
    assert _hooks.waiting() == 0
