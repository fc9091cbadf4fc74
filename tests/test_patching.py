"""install()/uninstall(): the post-init patch on real TrainingArguments / TRL configs, and callback registration."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch
import transformers.trainer as trainer_module
from trainers import HAS_ACTIVATION_FIELDS, TF5, common_args, make_trainer
from transformers import TrainingArguments

import trl_gc_plugin
from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.model.ckpt import functions as checkpoint_functions
from trl_gc_plugin.model.probe import get_record
from trl_gc_plugin.routes.callback import AutoSafeGCCallback
from trl_gc_plugin.testing import make_model


def test_import_patches_nothing_and_imports_nothing_heavy():
    code = (
        "import sys, trl_gc_plugin\n"
        "heavy = [m for m in ('torch', 'transformers', 'trl') if m in sys.modules]\n"
        "from transformers import TrainingArguments\n"
        "import transformers.trainer as t\n"
        "assert not getattr(TrainingArguments.__post_init__, '__trl_gc_plugin_wrapper__', False)\n"
        "assert not any('SafeGC' in c.__name__ for c in t.DEFAULT_CALLBACKS)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_install_uninstall_restore_exactly():
    original = TrainingArguments.__dict__["__post_init__"]
    defaults = list(trainer_module.DEFAULT_CALLBACKS)
    trl_gc_plugin.install()
    trl_gc_plugin.install()  # idempotent
    try:
        assert trl_gc_plugin.is_installed()
        assert TrainingArguments.__dict__["__post_init__"] is not original
        assert trainer_module.DEFAULT_CALLBACKS.count(AutoSafeGCCallback) == 1
    finally:
        trl_gc_plugin.uninstall()
    assert TrainingArguments.__dict__["__post_init__"] is original
    assert defaults == trainer_module.DEFAULT_CALLBACKS
    assert not trl_gc_plugin.is_installed()
    trl_gc_plugin.uninstall()  # harmless twice


def test_unpatched_default_differs_by_transformers_version(tmp_path):
    """Pin the upstream behaviour the plugin exists for: nothing in the args, and 4.x runs reentrant."""
    args = TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True))
    assert args.gradient_checkpointing_kwargs is None
    model = make_model()
    model.gradient_checkpointing_enable()
    from trl_gc_plugin.model.ckpt import model_use_reentrant

    assert model_use_reentrant(model) is (not TF5)


def _configs():
    from trl import DPOConfig, GRPOConfig, SFTConfig

    return [TrainingArguments, SFTConfig, DPOConfig, GRPOConfig]


@pytest.mark.parametrize("cls_index", range(4), ids=["TrainingArguments", "SFTConfig", "DPOConfig", "GRPOConfig"])
def test_every_config_class_gets_the_default_at_construction(cls_index, tmp_path, plugin_log):
    cls = _configs()[cls_index]
    extra = {"num_generations": 2} if cls.__name__ == "GRPOConfig" else {}
    with trl_gc_plugin.installed():
        args = cls(**common_args(str(tmp_path), gradient_checkpointing=True, **extra))
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    if HAS_ACTIVATION_FIELDS:
        assert args.activation_checkpointing_kwargs is args.gradient_checkpointing_kwargs
    assert (get_record(args).value, get_record(args).value_source) == (False, "plugin")
    assert "[non-reentrant-default] default" in plugin_log.text


def test_user_values_and_other_keys_are_kept(tmp_path):
    from trl import SFTConfig

    with trl_gc_plugin.installed():
        # gradient_checkpointing explicit: TRL 0.20's SFTConfig defaults it to False (later TRLs to True)
        args = SFTConfig(**common_args(str(tmp_path), gradient_checkpointing=True,
                                       gradient_checkpointing_kwargs={"use_reentrant": True, "preserve_rng_state": False}))
        unset = SFTConfig(**common_args(str(tmp_path), gradient_checkpointing=True,
                                        gradient_checkpointing_kwargs={"preserve_rng_state": False}))
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": True, "preserve_rng_state": False}
    assert get_record(args).user_given and get_record(args).user_value is True
    assert unset.gradient_checkpointing_kwargs == {"use_reentrant": False, "preserve_rng_state": False}


def test_gc_off_is_left_alone(tmp_path):
    with trl_gc_plugin.installed():
        args = TrainingArguments(**common_args(str(tmp_path)))
    assert args.gradient_checkpointing_kwargs is None


def test_json_string_kwargs_from_the_command_line(tmp_path):
    with trl_gc_plugin.installed():
        args = TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True,
                                               gradient_checkpointing_kwargs='{"use_reentrant": "false"}'))
    assert args.gradient_checkpointing_kwargs["use_reentrant"] is False


def test_string_value_from_yaml_is_coerced_and_garbage_refused(tmp_path, plugin_log):
    with trl_gc_plugin.installed():
        args = TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True,
                                               gradient_checkpointing_kwargs={"use_reentrant": "false"}))
        assert args.gradient_checkpointing_kwargs["use_reentrant"] is False
        assert "[invalid-use-reentrant] repair" in plugin_log.text
        with pytest.raises(GCConfigError, match="invalid-use-reentrant") as err:
            TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": "maybe"}))
    assert isinstance(err.value, ValueError)
    assert "use_reentrant" in str(err.value) and "mode='fix'" in str(err.value)


def test_strict_mode_error_changes_nothing(tmp_path):
    """A refused setup is left exactly as the user wrote it: no parameter updated, config and hooks as they were."""
    from peft import LoraConfig, get_peft_model

    if TF5:
        pytest.skip("transformers 5 adds the input-grad hook itself: reentrant is fine here")
    model = get_peft_model(make_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with pytest.raises(GCConfigError, match="frozen-inputs-need-non-reentrant"):  # certain: refused at once
        make_trainer("trainer", model, str(tmp_path), gc_kwargs={"use_reentrant": True}, callbacks=[SafeGCCallback()])
    assert model.config.use_cache is True

    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    trainer = make_trainer("trainer", model, str(tmp_path), gc_kwargs={"use_reentrant": True},
                           callbacks=[SafeGCCallback()])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(GCConfigError, match="frozen-inputs-observed"):  # seen in the first forward
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert model.config.use_cache is True
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert all(isinstance(f, functools.partial) for _, f in checkpoint_functions(model))


def test_installed_trainers_get_the_callback_once_even_when_also_passed(tmp_path, plugin_log):
    explicit = SafeGCCallback()
    with trl_gc_plugin.installed():
        trainer = make_trainer("trainer", make_model(), str(tmp_path), gc_kwargs=None, callbacks=[explicit])
        auto = [c for c in trainer.callback_handler.callbacks if isinstance(c, AutoSafeGCCallback)]
        assert len(auto) == 1
        trainer.train()
    assert explicit.decisions is auto[0].decisions  # the passive one reports what the active one did
    init_lines = [r for r in plugin_log.records if "[non-reentrant-default]" in r.getMessage()
                  and "init_end" not in r.getMessage()]
    # one line at construction (post-init) and one at on_init_end: not doubled by the second registration
    assert len(init_lines) == 2, [r.getMessage() for r in init_lines]
    stages = [d.stage for d in explicit.decisions]
    assert stages[0] == "post_init" and "init_end" in stages


def test_no_message_repeats_within_a_process(tmp_path, plugin_log):
    """install() decides at construction and the callback again at on_init_end: the same decision is logged once;
    a second identical run in the same process logs its summary again and nothing else twice."""
    with trl_gc_plugin.installed():
        for run in ("a", "b"):
            make_trainer("trainer", make_model(), str(tmp_path / run), gc_kwargs=None).train()
    lines = [r.getMessage() for r in plugin_log.records if r.name == "trl_gc_plugin.decisions"]
    assert lines and len(lines) == len(set(lines)), lines
    summaries = [r.getMessage() for r in plugin_log.records if r.name == "trl_gc_plugin"]
    assert len([m for m in summaries if m.startswith("gradient checkpointing on")]) == 2


@pytest.mark.parametrize("spelling", ["fix", "FIX", " Fix "])
def test_install_mode_reaches_the_registered_callback(spelling, tmp_path):
    with trl_gc_plugin.installed(mode=spelling):
        trainer = make_trainer("trainer", make_model(), str(tmp_path))
    (auto,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, AutoSafeGCCallback)]
    assert auto.mode == "fix" and SafeGCCallback(mode=spelling).mode == "fix"


def test_an_explicit_callback_acts_before_the_automatic_one(tmp_path, plugin_log):
    explicit = SafeGCCallback(mode="warn")
    with trl_gc_plugin.installed(mode="strict"):
        trainer = make_trainer("trainer", make_model(), str(tmp_path), callbacks=[explicit])
    (auto,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, AutoSafeGCCallback)]
    assert explicit._active and not auto._active and auto.decisions is explicit.decisions
    assert "the one passed to the Trainer acts (mode=warn)" in plugin_log.text


def test_values_set_by_the_user_are_attributed_without_install(tmp_path):
    callback = SafeGCCallback()
    make_trainer("trainer", make_model(), str(tmp_path), gc_kwargs={"use_reentrant": False}, callbacks=[callback])
    decided = [d for d in callback.decisions if d.setting == "use_reentrant"]
    assert decided and all(d.source == "user" for d in decided)


def test_callback_takes_no_required_arguments_and_reads_the_mode_from_the_env(monkeypatch):
    monkeypatch.setenv("TRL_GC_PLUGIN_MODE", "warn")
    assert SafeGCCallback().mode == "warn"
    monkeypatch.setenv("TRL_GC_PLUGIN_MODE", "bogus")
    assert SafeGCCallback().mode == "strict"
    with pytest.raises(ValueError):
        SafeGCCallback(mode="bogus")
