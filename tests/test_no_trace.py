"""Leave no trace: what a run under the plugin saves loads where the plugin is not installed, and equals what the same
run saves without it, except for the training settings the plugin changed on purpose (listed here).

Every artefact of real checkpoints (Trainer and SFT, full and LoRA) is loaded in a fresh interpreter where importing
`trl_gc_plugin` raises (a `sys.meta_path` blocker): `training_args.bin`, `trainer_state.json`, `config.json`,
adapter configs and weights, optimizer, scheduler and RNG states. Resuming works without the plugin, and with it
reaches the same decisions.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from trainers import HAS_ACTIVATION_FIELDS, build_model, make_trainer

import trl_gc_plugin
from trl_gc_plugin import SafeGCCallback

BLOCKER = textwrap.dedent("""
    import sys

    class _NoPlugin:
        def find_spec(self, name, path=None, target=None):
            if name == "trl_gc_plugin" or name.startswith("trl_gc_plugin."):
                raise ImportError("trl_gc_plugin is not installed here")
            return None

    sys.meta_path.insert(0, _NoPlugin())
""")

LOAD_ALL = BLOCKER + textwrap.dedent("""
    import json, os, sys
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, TrainerState

    out = {}
    for ckpt in sys.argv[1:]:
        files = {}
        for name in sorted(os.listdir(ckpt)):
            path = os.path.join(ckpt, name)
            if name.endswith(".json"):
                with open(path) as fh:
                    files[name] = json.load(fh)
            elif name.endswith((".bin", ".pt", ".pth")):
                obj = torch.load(path, weights_only=False)
                files[name] = {k: repr(v) for k, v in sorted(vars(obj).items())} if name == "training_args.bin" else type(obj).__name__
            elif name.endswith(".safetensors"):
                files[name] = sorted(load_file(path))
        if "config.json" in files:
            AutoConfig.from_pretrained(ckpt)
        if "adapter_config.json" in files:
            from peft import PeftConfig
            PeftConfig.from_pretrained(ckpt)
        TrainerState.load_from_json(os.path.join(ckpt, "trainer_state.json"))
        out[ckpt] = files
    assert "trl_gc_plugin" not in sys.modules
    print(json.dumps(out))
""")

# What the plugin changes on purpose in the saved arguments: the explicit use_reentrant (both field names on >= 5.23).
CHANGED_ON_PURPOSE = {"gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"}
PATHS = {"output_dir", "logging_dir", "run_name"}
TIMINGS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}


def _train_and_save(kind, variant, out, tiny_checkpoint, plugin):
    model, peft_config = build_model(variant, kind, tiny_checkpoint)
    callbacks = [SafeGCCallback()] if plugin else None
    # Without the plugin, LoRA needs use_reentrant=False written by hand on transformers 4.x (else "element 0 of
    # tensors does not require grad"); the full model trains with the value unset on every version.
    kwargs = {"use_reentrant": False} if variant == "lora" and not plugin else None
    trainer = make_trainer(kind, model, str(out), gc_kwargs=kwargs, callbacks=callbacks, peft_config=peft_config,
                           max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    (ckpt,) = Path(out).glob("checkpoint-*")
    return trainer, ckpt


def _without_plugin(code, *argv):
    proc = subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _trained(tmp_path_factory, tiny_checkpoint):
    cases = {}
    base = tmp_path_factory.mktemp("no-trace")
    for kind in ("trainer", "sft"):
        for variant in ("full", "lora"):
            plugged = _train_and_save(kind, variant, base / f"{kind}-{variant}-plugin", tiny_checkpoint, True)
            bare = _train_and_save(kind, variant, base / f"{kind}-{variant}-bare", tiny_checkpoint, False)
            cases[(kind, variant)] = (plugged, bare)
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_checkpoint):
    cases = _trained(tmp_path_factory, tiny_checkpoint)
    dirs = [c for pair in cases.values() for _, c in pair]
    loaded = json.loads(_without_plugin(LOAD_ALL, *dirs))
    return cases, loaded


CASES = [("trainer", "full"), ("trainer", "lora"), ("sft", "full"), ("sft", "lora")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_every_artefact_loads_without_the_plugin_and_equals_a_plugin_free_run(runs, case):
    cases, loaded = runs
    (_, plugged_ckpt), (_, bare_ckpt) = cases[case]
    plugged, bare = loaded[str(plugged_ckpt)], loaded[str(bare_ckpt)]
    assert set(plugged) == set(bare), "the plugin added or removed a file"
    assert "gc_decisions.json" not in plugged  # the plugin's file lives in the output dir, not in checkpoints
    for name in plugged:
        if name == "training_args.bin":
            differ = {k for k in plugged[name] if plugged[name][k] != bare[name].get(k)} - PATHS
            assert differ <= CHANGED_ON_PURPOSE, differ
            if differ:  # the one change on purpose: use_reentrant written explicitly
                assert "'use_reentrant': False" in plugged[name]["gradient_checkpointing_kwargs"]
        elif name == "trainer_state.json":
            strip = [{k: v for k, v in e.items() if k not in TIMINGS} for e in plugged[name].pop("log_history")]
            bare_strip = [{k: v for k, v in e.items() if k not in TIMINGS} for e in bare[name].pop("log_history")]
            assert [sorted(e) for e in strip] == [sorted(e) for e in bare_strip]
            assert plugged[name] == bare[name]
        else:  # config.json (use_cache as without the plugin), adapter config, tokenizer files, weights' keys
            assert plugged[name] == bare[name], name


def test_nothing_of_the_plugin_is_pickled_with_the_arguments_or_the_state(runs):
    cases, _ = runs
    for (trainer, _), _ in cases.values():
        for obj in (trainer.args, trainer.state):
            assert b"trl_gc_plugin" not in pickle.dumps(obj)
            assert not [k for k in vars(obj) if "trl_gc_plugin" in k]
        assert "trl_gc_plugin" not in json.dumps(trainer.model.config.to_dict(), default=str)


def test_install_writes_nothing_into_the_arguments(tmp_path):
    from transformers import TrainingArguments

    with trl_gc_plugin.installed():
        args = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, report_to="none",
                                 use_cpu=True)
        off = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert args.gradient_checkpointing_kwargs == {"use_reentrant": False}  # the decision, in a field of its own
    for obj in (args, off):
        assert b"trl_gc_plugin" not in pickle.dumps(obj)
    assert trl_gc_plugin.model.probe.get_record(args) is not None  # the plugin still knows who set what


RESUME = BLOCKER + textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    ckpt, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(3, 200, (16,)), "labels": torch.randint(3, 200, (16,))} for _ in range(8)]
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=2, use_cpu=True,
                             report_to="none", save_strategy="no", disable_tqdm=True, gradient_checkpointing=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=ckpt)
    print(json.dumps({"step": trainer.state.global_step, "plugin": "trl_gc_plugin" in sys.modules}))
""")


def test_resume_without_the_plugin_and_with_it(runs, tmp_path):
    cases, _ = runs
    (trainer, ckpt), _ = cases[("trainer", "full")]
    result = json.loads(_without_plugin(RESUME, ckpt, tmp_path / "resumed-bare").strip().splitlines()[-1])
    assert result == {"step": 4, "plugin": False}

    # with the plugin: the same decisions as the run that wrote the checkpoint
    from trainers import make_trainer as again
    from transformers import AutoModelForCausalLM

    callback = SafeGCCallback()
    resumed = again("trainer", AutoModelForCausalLM.from_pretrained(ckpt), str(tmp_path / "resumed"),
                    callbacks=[callback], max_steps=4)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4

    def key(decisions):
        return [(d.stage, d.rule_id, d.action, d.setting, repr(d.after)) for d in decisions if d.stage == "init_end"]

    original = [c for c in trainer.callback_handler.callbacks if isinstance(c, SafeGCCallback)][0]
    assert key(callback.decisions) == key(original.decisions)


def test_decisions_file_only_when_checkpointing_is_on(tmp_path):
    from trl_gc_plugin.testing import make_model

    off = make_trainer("trainer", make_model(), str(tmp_path / "off"), gc=False, callbacks=[SafeGCCallback()])
    off.train()
    assert not (tmp_path / "off" / "gc_decisions.json").exists()
    on = make_trainer("trainer", make_model(), str(tmp_path / "on"), callbacks=[SafeGCCallback()])
    on.train()
    assert (tmp_path / "on" / "gc_decisions.json").exists()


def test_the_arguments_differ_only_in_the_decided_field(runs):
    cases, loaded = runs
    (_, plugged_ckpt), (_, bare_ckpt) = cases[("trainer", "full")]
    plugged = loaded[str(plugged_ckpt)]["training_args.bin"]
    bare = loaded[str(bare_ckpt)]["training_args.bin"]
    differ = {k for k in plugged if plugged[k] != bare.get(k)} - PATHS
    expected = {"gradient_checkpointing_kwargs"} | ({"activation_checkpointing_kwargs"} if HAS_ACTIVATION_FIELDS
                                                    else set())
    assert differ == expected, differ
