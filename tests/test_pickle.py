"""The Trainer's callbacks pickle with the plugin wherever they pickle without it (issue 46): `pickle.dumps(
trainer.callback_handler)` before and after `train()`, on the callback route and the `install()` route. A copy keeps
what was decided and carries no hook (the plugin's hooks are registered by identity in one process-wide registry)."""

from __future__ import annotations

import copy
import pickle

import pytest
from trainers import make_trainer

import trl_gc_plugin
from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model import hooks as _hooks
from trl_gc_plugin.testing import make_model


def pickles(obj) -> str | None:
    """None if `obj` pickles, else the error."""
    try:
        pickle.dumps(obj)
    except Exception as exc:  # the outcome is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def handler_outcomes(tmp_path, route: str | None) -> tuple[str | None, str | None, list]:
    """(before train, after train) of pickling the handler of a plain Trainer (reentrant, frozen embeddings: the
    plugin repairs and hooks), and the plugin's callbacks of that Trainer."""

    def build():
        model = make_model()
        model.get_input_embeddings().weight.requires_grad_(False)
        callbacks = [SafeGCCallback(mode="fix")] if route == "callback" else None
        return make_trainer("trainer", model, str(tmp_path / str(route)), gc_kwargs={"use_reentrant": True},
                            callbacks=callbacks, max_steps=2)

    if route == "install":
        with trl_gc_plugin.installed(mode="fix"):
            trainer = build()
            before = pickles(trainer.callback_handler)
            trainer.train()
    else:
        trainer = build()
        before = pickles(trainer.callback_handler)
        trainer.train()
    after = pickles(trainer.callback_handler)
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, SafeGCCallback)]
    return before, after, ours


@pytest.mark.parametrize("route", ["callback", "install"])
def test_the_callback_handler_pickles_before_and_after_training_as_without_the_plugin(tmp_path, route):
    plain_before, plain_after, _ = handler_outcomes(tmp_path, None)
    before, after, ours = handler_outcomes(tmp_path, route)
    assert plain_before is None  # the plugin-free handler pickles before training on every transformers line
    assert before == plain_before
    # after training: as without the plugin (transformers 5 leaves a local function on the embeddings, which does not
    # pickle, plugin or not)
    assert (after is None) == (plain_after is None), (after, plain_after)
    assert len(ours) == 1
    callback = ours[0]
    assert pickles(callback) is None  # the callback itself pickles after training on every line
    waiting = _hooks.waiting()
    restored = pickle.loads(pickle.dumps(callback))
    assert [d.line() for d in restored.decisions] == [d.line() for d in callback.decisions]
    assert restored.decisions and restored._run.reentrant.value is callback._run.reentrant.value
    assert len(restored._run.hooks) == 0 and restored._run.model is None and restored._run.stopped
    assert _hooks.waiting() == waiting
    twin = copy.deepcopy(callback)  # a deep copy goes through the same state: no hook either
    assert len(twin._run.hooks) == 0 and twin._run.model is None and twin.decisions == callback.decisions


def test_a_callback_pickles_while_its_run_is_live():
    """In the middle of the first step (its checks armed, the model hooked): the copy carries none of it, and the
    original's hooks are untouched."""
    import torch

    from trl_gc_plugin.runtime.run import Run

    callback = SafeGCCallback(mode="fix")
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    from trl_gc_plugin.routes.model_route import LoopConfig

    args = LoopConfig(True, {"use_reentrant": True})
    run: Run = callback._run
    run.decide(args, model)
    facts = run.begin(args, model, asked=True)
    run.arm_first_step(facts, model)
    held = len(run.hooks)
    assert held and run.first_step_pending
    restored = pickle.loads(pickle.dumps(callback))
    assert len(restored._run.hooks) == 0 and not restored._run.first_step_pending and restored._run.model is None
    assert len(run.hooks) == held
    ids = torch.randint(3, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    run.stop()
