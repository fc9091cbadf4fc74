"""What a user reads of the plugin at the default level (issue 46): the `trl_gc_plugin` lines the plugin's own stderr
handler writes (the Trainer's `log_level="passive"`: INFO and above), on the main process. Nothing when checkpointing
is off; the routine repairs of TRL's per-step re-enables said in words at DEBUG, never at INFO; no line written onto
a live progress bar's line (the Trainer's tqdm bar is open until after the callbacks' `on_train_end`).
"""

from __future__ import annotations

import pytest
from trainers import TF5, make_trainer

import trl_gc_plugin
from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.testing import make_model

PREFIX = "[trl_gc_plugin]"


def plugin_lines(err: str) -> list[str]:
    """Each piece of stderr (split at newlines and carriage returns) that holds a line of the plugin."""
    return [piece for line in err.split("\n") for piece in line.split("\r") if PREFIX in piece]


def train(kind: str, tmp_path, route: str, **overrides):
    """Train `kind` for 3 steps on the `route` (`callback`: passed to the Trainer; `install`: `installed()`)."""
    callbacks = [SafeGCCallback()] if route == "callback" else None
    if route == "install":
        with trl_gc_plugin.installed():
            trainer = make_trainer(kind, make_model(), str(tmp_path), callbacks=callbacks, **overrides)
            trainer.train()
    else:
        trainer = make_trainer(kind, make_model(), str(tmp_path), callbacks=callbacks, **overrides)
        trainer.train()
    return trainer


@pytest.mark.parametrize("route", ["callback", "install"])
def test_checkpointing_off_says_nothing_at_the_default_level(tmp_path, capsys, route):
    train("trainer", tmp_path, route, gc=False)
    assert plugin_lines(capsys.readouterr().err) == []


def test_checkpointing_off_is_still_said_at_debug(tmp_path, capsys):
    train("trainer", tmp_path, "callback", gc=False, log_level="debug")
    assert any("gradient checkpointing is off" in line for line in plugin_lines(capsys.readouterr().err))


def test_a_dpo_run_ends_without_a_repeat_line_and_nothing_on_the_progress_bar(tmp_path, capsys):
    """TRL's DPO re-enables checkpointing every step: the plugin removes the duplicate input hook each time, and says
    nothing of it at the default level; the one summary line, at init, on its own line."""
    train("dpo", tmp_path, "install", gc_kwargs={"use_reentrant": False}, disable_tqdm=False)
    lines = plugin_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(f"{PREFIX} INFO: gradient checkpointing on"), lines


def test_the_repeats_are_said_in_words_at_debug_between_the_bars_redraws(tmp_path, capsys):
    """At `log_level="debug"` the repeat line is written at the end of training, while the progress bar is still
    open: between its redraws (tqdm's external write mode), never glued onto its line."""
    train("dpo", tmp_path, "install", gc_kwargs={"use_reentrant": False}, disable_tqdm=False, log_level="debug")
    lines = plugin_lines(capsys.readouterr().err)
    assert all(line.startswith(PREFIX) for line in lines), [line for line in lines if not line.startswith(PREFIX)]
    repeats = [line for line in lines if "duplicate input-require-grad hook" in line]
    if not TF5:  # 4.57's enable adds no input-require-grad hook to a full model: nothing piles up, nothing repeats
        assert repeats == []
        return
    assert len(repeats) == 1 and "re-enabled during training" in repeats[0] and "{" not in repeats[0], lines
