"""Context parallelism (issue 26, item 10) and the compile backend of an accelerate config: `trl-gc-check` and the run
read accelerate's `ParallelismConfig` through one reader (`_parallel`) and say the same thing.

The failure itself (trl #4314: a backward outside `maybe_context_parallel` recomputes unsharded attention,
CheckpointError) needs GPUs: torch 2.13's context-parallel dispatcher replaces only the CUDA SDPA kernels. What runs
here is everything the plugin does with the setting: it reads it wherever a launch puts it, and the rule
`context-parallel-backward-in-context` says what it means, as a note (the Trainer runs the backward inside the
context), never a refusal.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

import trl_gc_plugin
from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.configcheck.check import Launch, check_files
from trl_gc_plugin.core.context_parallel import cp_size_from_args, cp_size_from_env, cp_size_of
from trl_gc_plugin.testing import make_model

RULE = "context-parallel-backward-in-context"
COMPILE = "torch-compile-first-step"

ACCELERATE_CP = """distributed_type: FSDP
num_processes: 4
fsdp_config: {fsdp_version: 2}
parallelism_config:
  parallelism_config_dp_shard_size: 2
  parallelism_config_cp_size: 2
"""


def said(decisions, rule_id):
    return [(d.action, d.level, d.reason) for d in decisions if d.rule_id == rule_id]


def checked(tmp_path, text, accelerate=None, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    launch = Launch(parser="model", accelerate_config=str(accelerate)) if accelerate else Launch(parser="model")
    (report,) = check_files([str(path)], launch)
    assert report.status == "ok", report.error
    return report


def test_the_reader_takes_accelerates_names_and_refuses_what_accelerate_refuses():
    assert cp_size_of({"parallelism_config_cp_size": 4}) == 4
    assert cp_size_of({"PARALLELISM_CONFIG_CP_SIZE": "2"}) == 2
    assert cp_size_of({}) == 1
    assert cp_size_of({"parallelism_config_cp_size": 0}) is None
    assert cp_size_of({"parallelism_config_cp_size": True}) is None
    assert cp_size_of({"parallelism_config_cp_size": "two"}) is None
    # accelerate builds a ParallelismConfig from the environment only when told to
    assert cp_size_from_env({"PARALLELISM_CONFIG_CP_SIZE": "2"}) == 1
    assert cp_size_from_env({"PARALLELISM_CONFIG_CP_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true"}) == 2


def test_the_arguments_object_is_read_as_the_accelerator_reads_it(tmp_path):
    from accelerate import ParallelismConfig

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", parallelism_config=ParallelismConfig(cp_size=2))
    assert cp_size_from_args(args, env={}) == 2
    assert cp_size_from_args(TrainingArguments(output_dir=str(tmp_path), report_to="none"), env={}) == 1


def test_the_check_and_the_trainer_route_say_the_same(tmp_path, monkeypatch):
    """A TRL CLI config launched with an accelerate config that has a `parallelism_config` block, and the Trainer's
    callback at `on_init_end` on the arguments such a launch gives (`parallelism_config.cp_size` 2)."""
    from accelerate import ParallelismConfig

    accelerate = tmp_path / "cp.yaml"
    accelerate.write_text(ACCELERATE_CP)
    report = checked(tmp_path, "model_name_or_path: m\ndataset_name: d\n", accelerate)
    assert report.facts.cp_size == 2 and report.sources["cp_size"].origin == "accelerate config"
    from_check = said(report.decisions, RULE)
    assert [(a, lvl) for a, lvl, _ in from_check] == [("none", "info")]
    assert not [d for d in report.decisions if d.action == "error"]

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", gradient_checkpointing=True,
                             parallelism_config=ParallelismConfig(cp_size=2))
    callback = SafeGCCallback()
    model = make_model()
    callback.on_init_end(args, TrainerState(), TrainerControl(), model=model)
    try:
        assert said(callback.decisions, RULE) == from_check
    finally:
        callback.on_train_end(args, TrainerState(), TrainerControl(), model=model)

    # nothing said without the block
    accelerate.write_text(ACCELERATE_CP.split("parallelism_config:")[0])
    assert not said(checked(tmp_path, "model_name_or_path: m\ndataset_name: d\n", accelerate).decisions, RULE)


@pytest.mark.parametrize("key", ["context_parallel_size", "sequence_parallel_degree"])
def test_axolotls_context_parallel_size_is_the_same_setting(tmp_path, key):
    report = checked(tmp_path, f"base_model: m\ngradient_checkpointing: true\n{key}: 2\n", name="ax.yml")
    assert report.facts.cp_size == 2 and key in report.sources["cp_size"].detail
    ((action, level, reason),) = said(report.decisions, RULE)
    assert (action, level) == ("none", "info") and reason.startswith("Context parallelism (cp_size=2):")


def test_the_model_route_reads_the_environment_accelerate_launch_exports(tmp_path, monkeypatch):
    """A loop without a Trainer under `accelerate launch` with the block: the environment the launcher exports (and
    Axolotl's `setup_parallelism_envs`) gives the same decision as the check."""
    accelerate = tmp_path / "cp.yaml"
    accelerate.write_text(ACCELERATE_CP)
    from_check = said(checked(tmp_path, "model_name_or_path: m\ndataset_name: d\n", accelerate).decisions, RULE)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    decisions = trl_gc_plugin.guard(model, mode="strict")
    assert said(decisions, RULE) == from_check
    # the run trains: a note, not a refusal
    ids = torch.randint(3, 60, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_an_accelerate_dynamo_backend_is_the_compile_the_run_sees(tmp_path, monkeypatch):
    """`dynamo_config.dynamo_backend` in an accelerate config is exported as `ACCELERATE_DYNAMO_BACKEND`, which the
    run reads as a compiled forward: the check says what the run says (rule `torch-compile-first-step`)."""
    accelerate = tmp_path / "dyn.yaml"
    accelerate.write_text("distributed_type: 'NO'\ndynamo_config:\n  dynamo_backend: INDUCTOR\n")
    report = checked(tmp_path, "model_name_or_path: m\ndataset_name: d\n", accelerate)
    from_check = said(report.decisions, COMPILE)
    assert [(a, lvl) for a, lvl, _ in from_check] == [("none", "info")]
    assert from_check[0][2].startswith("ACCELERATE_DYNAMO_BACKEND=INDUCTOR:")

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", gradient_checkpointing=True)
    callback = SafeGCCallback()
    model = make_model()
    callback.on_init_end(args, TrainerState(), TrainerControl(), model=model)
    try:
        assert said(callback.decisions, COMPILE) == from_check
    finally:
        callback.on_train_end(args, TrainerState(), TrainerControl(), model=model)

    for off in ("'NO'", "NO", "no"):  # unquoted, YAML reads NO as false; accelerate's own default is 'no'
        accelerate.write_text(f"distributed_type: 'NO'\ndynamo_config:\n  dynamo_backend: {off}\n")
        assert not said(checked(tmp_path, "model_name_or_path: m\ndataset_name: d\n", accelerate).decisions, COMPILE)
