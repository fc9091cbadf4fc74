from __future__ import annotations

import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.pop("TRL_GC_PLUGIN", None)
os.environ.pop("TRL_GC_PLUGIN_MODE", None)


@pytest.fixture(autouse=True)
def environment_restored():
    """transformers' TrainingArguments writes launcher variables (ACCELERATE_USE_FSDP, ...) into os.environ."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_patch_left_behind():
    """Every test must leave transformers exactly as it found it."""
    import transformers.trainer as trainer_module
    from transformers import PreTrainedModel, TrainingArguments

    post_init = TrainingArguments.__dict__["__post_init__"]
    defaults = list(trainer_module.DEFAULT_CALLBACKS)
    enables = {name: PreTrainedModel.__dict__.get(name) for name in ("gradient_checkpointing_enable",
                                                                    "activation_checkpointing_enable")}
    yield
    assert TrainingArguments.__dict__["__post_init__"] is post_init, "a test left __post_init__ patched"
    assert list(trainer_module.DEFAULT_CALLBACKS) == defaults, "a test left DEFAULT_CALLBACKS changed"
    assert {name: PreTrainedModel.__dict__.get(name) for name in enables} == enables, "a test left enable patched"


@pytest.fixture(autouse=True)
def no_hook_left_waiting():
    """Every run, refused or not, must leave no callback in the plugin's process-wide hook table (a waiting one
    keeps its model alive and the process-wide hooks registered)."""
    import gc

    from trl_gc_plugin.model import hooks as _hooks

    def left() -> tuple[int, list[str]]:
        return _hooks.waiting(), _hooks.patched_classes()

    if any(left()):
        gc.collect()  # a model a test dropped takes its class-level dispatch with it (held weakly)
    before = left()
    yield
    if left() != before:
        gc.collect()
    assert left() == before, "a test left hooks waiting in trl_gc_plugin.model.hooks, or a class method dispatched"


@pytest.fixture(autouse=True)
def fresh_plugin_logging():
    """Each test starts with the plugin's logging as a new process has it (no message seen yet, no handler)."""
    from trl_gc_plugin._base import report

    report.reset()
    yield
    report.reset()


@pytest.fixture
def plugin_log(caplog):
    """Every record of the plugin's loggers, details included (as with the Trainer's log_level="info")."""
    caplog.set_level(logging.INFO, logger="trl_gc_plugin")
    caplog.set_level(logging.INFO, logger="trl_gc_plugin.decisions")
    return caplog


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny Llama and its tokenizer saved to disk (for 4-bit loading and the CLI)."""
    from trl_gc_plugin.testing import make_model, make_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    make_model().save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)
