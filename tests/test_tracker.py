"""The plugin's decisions reach the run's tracker: a real TensorBoard run directory, read back with TensorBoard's own
reader, holds the summary; nothing of it reaches the trainer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainers import make_trainer

import trl_gc_plugin
from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.runtime import tracker
from trl_gc_plugin.testing import make_model

pytest.importorskip("tensorboard")


def read_back(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = {p.parent for p in logdir.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = {}
    for tag in acc.Tags().get("tensors", []):
        if tag.endswith("/text_summary"):
            texts[tag.removesuffix("/text_summary")] = acc.Tensors(tag)[0].tensor_proto.string_val[0].decode()
    return scalars, texts


@pytest.mark.parametrize("route", ["callback", "install"])
def test_the_summary_is_in_the_tensorboard_run(route, tmp_path):
    logdir = tmp_path  # the run directory transformers picks under output_dir (logging_dir is gone in 5.x)
    extra = dict(report_to=["tensorboard"])
    kwargs = {"use_reentrant": True}
    if route == "install":
        with trl_gc_plugin.installed():
            trainer = make_trainer("trainer", make_model(), str(tmp_path / "out"), gc_kwargs=kwargs, max_steps=2,
                                   **extra)
            trainer.train()
    else:
        trainer = make_trainer("trainer", make_model(), str(tmp_path / "out"), gc_kwargs=kwargs, max_steps=2,
                               callbacks=[SafeGCCallback()], **extra)
        trainer.train()
    scalars, texts = read_back(logdir)
    assert scalars["train/trl_gc/use_reentrant"] == [1.0]  # once, at the first log
    assert scalars["train/trl_gc/refusals"] == [0.0]
    assert "train/loss" in scalars  # the reporter's own figures are there as before
    assert texts["train/trl_gc/use_reentrant_source"] == "user"
    assert texts["train/trl_gc/mode"] == "strict"
    history = json.dumps(trainer.state.log_history)
    assert "trl_gc" not in history  # nothing of the plugin in the trainer state


def test_a_passed_callback_moves_just_before_the_reporters_and_nothing_else_moves(tmp_path):
    from transformers import TrainerCallback

    class Mine(TrainerCallback):
        pass

    mine, plugin = Mine(), SafeGCCallback()
    trainer = make_trainer("trainer", make_model(), str(tmp_path), callbacks=[mine, plugin], max_steps=1,
                           report_to=["tensorboard"])
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("SafeGCCallback") == names.index("TensorBoardCallback") - 1
    assert names.index("Mine") > names.index("TensorBoardCallback")  # the user's own order is untouched


def test_mlflow_style_reporters_get_numbers_only():
    from trl_gc_plugin.core.decisions import Decision

    decisions = [Decision(rule_id="non-reentrant-default", action="default", setting="use_reentrant", before=None,
                          after=False, source="unset", reason="x", stage="init_end")]
    numbers = tracker.summary(decisions, False, "plugin", "strict", text=False)
    assert numbers and all(isinstance(v, int) for v in numbers.values())
    assert tracker.summary([], None, "unset", "strict") == {}
