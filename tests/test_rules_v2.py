"""Rule table v2: each failure reproduced without the plugin, then the plugin's outcome (strict / fix), on the
transformers lines where it applies."""

from __future__ import annotations

import functools

import pytest
import torch
from trainers import TF5, common_args, make_trainer
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from zoo_run import run

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.probe import block_pattern, reads_layer_kwargs
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

TF523 = reads_layer_kwargs({"transformers": __import__("transformers").__version__})


class PatternSeen:
    """The per-block checkpointing flags every training forward of `model` runs with."""

    def __init__(self, model):
        self.seen = []
        model.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if module.training and torch.is_grad_enabled():
            self.seen.append(block_pattern(module))


def four_layers():
    return make_model(num_hidden_layers=4)


def _grpo(kwargs, callbacks, tmp_path, max_steps=2):
    model = four_layers()
    seen = PatternSeen(model)
    trainer = make_trainer("grpo", model, str(tmp_path), gc_kwargs=kwargs, callbacks=callbacks, max_steps=max_steps)
    try:
        trainer.train()
    except Exception as exc:
        return seen.seen, f"{type(exc).__name__}: {exc}", trainer
    return seen.seen, None, trainer


# --- 1. every_n_layers lost across TRL's per-step re-enables (transformers >= 5.23) -----------------------------


@pytest.mark.skipif(not TF523, reason="every_n_layers is a transformers >= 5.23 setting")
def test_every_n_layers_is_lost_by_grpos_re_enables_without_the_plugin(tmp_path):
    seen, error, _ = _grpo({"use_reentrant": False, "every_n_layers": 2}, None, tmp_path / "a")
    assert error is None and seen and all(p == (True,) * 4 for p in seen)  # asked [1,0,1,0], ran [1,1,1,1]
    _, error, _ = _grpo({"use_reentrant": True, "every_n_layers": 2}, None, tmp_path / "b")
    assert error is not None and "Unexpected keyword arguments: every_n_layers" in error


@pytest.mark.skipif(not TF523, reason="every_n_layers is a transformers >= 5.23 setting")
@pytest.mark.parametrize("reentrant", [False, True])
def test_the_plugin_keeps_the_pattern_across_re_enables(reentrant, tmp_path):
    callback = SafeGCCallback()
    seen, error, trainer = _grpo({"use_reentrant": reentrant, "every_n_layers": 2}, [callback], tmp_path, 3)
    assert error is None, error
    assert seen and all(p == (True, False, True, False) for p in seen)
    assert "gradient_checkpointing_enable" not in trainer.model.__dict__  # the guard is gone after training
    assert not [d for d in callback.decisions if d.rule_id == "checkpointing-drift"]


# --- 2. every_n_layers / offload before transformers 5.23 ------------------------------------------------------


@pytest.mark.skipif(TF523, reason="transformers >= 5.23 reads every_n_layers itself")
def test_every_n_layers_before_5_23_without_and_with_the_plugin(tmp_path):
    def trainer(kwargs, callbacks, out):
        model = four_layers()
        seen = PatternSeen(model)
        return seen, make_trainer("trainer", model, str(tmp_path / out), gc_kwargs=kwargs, callbacks=callbacks)

    seen, bare = trainer({"use_reentrant": False, "every_n_layers": 2}, None, "bare")
    bare.train()
    assert seen.seen and all(p == (True,) * 4 for p in seen.seen)  # silently ignored: every layer checkpointed
    _, crashing = trainer({"use_reentrant": True, "every_n_layers": 2}, None, "crash")
    with pytest.raises(ValueError, match="Unexpected keyword arguments: every_n_layers"):
        crashing.train()

    callback = SafeGCCallback()
    seen, plugged = trainer({"use_reentrant": True, "every_n_layers": 2, "offload": True}, [callback], "plugin")
    (repair,) = [d for d in callback.decisions if d.rule_id == "layer-kwargs-need-transformers-5.23"]
    assert repair.action == "repair" and repair.level == "warning" and repair.before == ("every_n_layers", "offload")
    assert "every_n_layers" not in plugged.args.gradient_checkpointing_kwargs  # torch never gets them
    plugged.train()
    assert seen.seen and all(p == (True, False, True, False) for p in seen.seen)  # applied by the plugin


# --- 3. offload without an accelerator ------------------------------------------------------------------------


@pytest.mark.skipif(not TF523 or torch.cuda.is_available(), reason="transformers >= 5.23 on a CPU-only machine")
def test_offload_without_an_accelerator(tmp_path):
    kwargs = {"use_reentrant": False, "offload": True}
    bare = make_trainer("trainer", make_model(), str(tmp_path / "bare"), gc_kwargs=kwargs)
    with pytest.raises(RuntimeError, match="pin_memory"):
        bare.train()
    with pytest.raises(GCConfigError, match="offload-needs-accelerator"):
        make_trainer("trainer", make_model(), str(tmp_path / "strict"), gc_kwargs=kwargs,
                     callbacks=[SafeGCCallback()])
    fixed = make_trainer("trainer", make_model(), str(tmp_path / "fix"), gc_kwargs=kwargs,
                         callbacks=[SafeGCCallback(mode="fix")])
    assert "offload" not in fixed.args.activation_checkpointing_kwargs
    fixed.train()
