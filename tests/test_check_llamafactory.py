"""LLaMA-Factory configs: the plugin's model of LLaMA-Factory main@ff6d4d12 (= 0.9.5 for these keys), and, where
LLaMA-Factory is importable, its own `get_train_args` in a subprocess reading the same facts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trl_gc_plugin.configcheck.check import Launch, check_files
from trl_gc_plugin.configcheck.read.native import importable

pytestmark = pytest.mark.line_independent

DATA = Path(__file__).with_name("data")
LF = "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nstage: sft\ndo_train: true\ndataset: alpaca_en_demo\ntemplate: qwen\noutput_dir: saves/x\n"


def check(tmp_path, text, name="cfg.yaml", **launch):
    path = tmp_path / name
    path.write_text(text)
    (report,) = check_files([str(path)], Launch(parser="model", **launch))
    return report


def rules(report, action=None):
    return {d.rule_id for d in report.decisions if action is None or d.action == action}


def test_a_lora_sft_config_reads_as_lora_with_llamafactorys_reentrant_default(tmp_path):
    (report,) = check_files([str(DATA / "lf_lora_sft.yaml")], Launch(parser="model", nproc=4))
    facts = report.facts
    assert report.format == "llamafactory" and report.status == "ok"
    assert (facts.gc_enabled, facts.is_peft, facts.use_reentrant, facts.use_cache) == (True, True, True, False)
    assert report.sources["is_peft"].origin == "launcher default"  # finetuning_type defaults to lora
    assert report.sources["use_reentrant"].origin == "launcher default"
    assert facts.ddp_find_unused_parameters is False  # DDP + LoRA: LLaMA-Factory sets it
    assert "llamafactory:reentrant-default" in rules(report)


def test_qlora_with_the_example_zero3_config(tmp_path):
    (report,) = check_files([str(DATA / "lf_qlora_ds_z3.yaml")], Launch(parser="model", nproc=2))
    assert (report.facts.quantization, report.facts.zero_stage) == ("bitsandbytes_4bit", 3)
    assert report.status == "ok"  # reentrant by default: what old DeepSpeed needs anyway
    report = check(tmp_path, (DATA / "lf_qlora_ds_z3.yaml").read_text() + "use_reentrant_gc: false\n", nproc=2, versions=(("deepspeed", "0.19.2"),))
    assert rules(report, "error") == {"zero3-frozen-needs-reentrant"}
    assert report.change == "set use_reentrant_gc: true"


@pytest.mark.parametrize("name", ["lf_inference.yaml", "lf_merge.yaml"])
def test_chat_and_export_configs_train_nothing(name, capsys):
    from trl_gc_plugin.cli.check import check_main

    (report,) = check_files([str(DATA / name)], Launch(parser="model"))
    assert report.status == "ok" and report.training is False and report.facts.gc_enabled is False
    assert check_main([str(DATA / name), "--parser", "model"]) == 0
    assert "checkpointing does not apply" in capsys.readouterr().out


def test_a_quoted_false_disables_checkpointing_and_is_said(tmp_path):
    (report,) = check_files([str(DATA / "lf_string_disable.yaml")], Launch(parser="model"))
    assert report.facts.gc_enabled is False
    (warning,) = [d for d in report.decisions if d.rule_id == "llamafactory:string-boolean"]
    assert warning.action == "warn" and warning.before == {"disable_gradient_checkpointing": "false"}


def test_a_quoted_false_turns_ktransformers_on_and_is_said(tmp_path):
    """`use_kt` is tested for truth as the other boolean keys are: a quoted "false" turns KTransformers' own
    checkpointing on (not modelled: said in a note), and the quoted boolean is named."""
    report = check(tmp_path, LF + 'use_kt: "false"\n')
    (warning,) = [d for d in report.decisions if d.rule_id == "llamafactory:string-boolean"]
    assert warning.before == {"use_kt": "false"}
    assert any(note.startswith("use_kt: KTransformers") for note in report.notes)
    plain = check(tmp_path, LF + "use_kt: false\n")
    assert not [d for d in plain.decisions if d.rule_id == "llamafactory:string-boolean"]
    assert not any(note.startswith("use_kt") for note in plain.notes)


def test_without_do_train_nothing_checkpoints(tmp_path):
    report = check(tmp_path, LF.replace("do_train: true\n", "do_predict: true\n"))
    assert report.facts.gc_enabled is False


def test_fsdp2_accelerate_config_makes_it_non_reentrant(tmp_path):
    accelerate = tmp_path / "fsdp2.yaml"
    accelerate.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n")
    report = check(tmp_path, LF, accelerate_config=str(accelerate))
    assert (report.facts.use_reentrant, report.facts.fsdp, report.facts.world_size) == (False, True, 2)
    assert "FSDP2" in report.sources["use_reentrant"].detail and "llamafactory:fsdp2-non-reentrant" in rules(report)


def test_the_trainers_own_checkpointing_overrides_use_reentrant_gc(tmp_path):
    report = check(tmp_path, LF + "use_reentrant_gc: false\ngradient_checkpointing: true\n")
    assert report.facts.use_reentrant is True and "llamafactory:trainer-gc-overrides" in rules(report)
    report = check(tmp_path, LF + "use_reentrant_gc: false\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: false}\n")
    assert report.facts.use_reentrant is False and "llamafactory:trainer-gc-overrides" not in rules(report)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("finetuning_type: full\nquantization_bit: 4\n", "llamafactory:quantization-needs-adapter"),
        ("finetuning_type: freeze\nadapter_name_or_path: saves/a\n", "llamafactory:adapter-needs-lora"),
    ],
)
def test_llamafactorys_own_refusals(tmp_path, text, rule):
    report = check(tmp_path, LF + text)
    assert rule in rules(report, "error") and report.change


@pytest.mark.parametrize(
    ("text", "facts"),
    [
        ("finetuning_type: freeze\n", {"is_peft": False, "frozen_params": True}),
        ("finetuning_type: full\n", {"is_peft": False, "frozen_params": False}),
        ("finetuning_type: oft\nquantization_bit: 8\n", {"is_peft": True, "quantization": "bitsandbytes_8bit"}),
        ("quantization_bit: 4\nquantization_method: hqq\n", {"quantization": "hqq"}),
        ("stage: dpo\n", {"trainer_kind": "dpo", "rl_trainer": True}),
        ("use_unsloth_gc: true\n", {"offload": False, "use_reentrant": True}),
        ("use_unsloth: true\n", {"unsloth": True}),
    ],
)
def test_keys(tmp_path, text, facts):
    report = check(tmp_path, LF.replace("stage: sft\n", "") + text)
    assert {k: getattr(report.facts, k) for k in facts} == facts


def test_unsloth_owns_checkpointing(tmp_path):
    report = check(tmp_path, LF + "use_unsloth: true\n")
    assert "unsloth-owns-checkpointing" in rules(report)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("finetuning_type: LoRA\n", "LLaMA-Factory asserts one of lora, oft, freeze, full"),
        ("stage: grpo\n", "not one of LLaMA-Factory's stages"),
        ("quantization_bit: '4'\n", "expected a whole number such as 4 or 8"),
        ("deepspeed: [1]\n", "key 'deepspeed'"),
        ("deepspeed: my_ds.json\n", "DeepSpeed config 'my_ds.json' not found"),
    ],
)
def test_wrong_values_exit_2(tmp_path, text, message):
    report = check(tmp_path, LF.replace("stage: sft\n", "") + text)
    assert report.status == "error" and message in report.error, report.error


def test_a_v1_config_is_said_to_be_unsupported(tmp_path):
    report = check(tmp_path, "model: Qwen/Qwen3-4B\nmodel_class: llm\ntrain_dataset: data/x.yaml\ndist_config: {name: fsdp2}\n")
    assert report.status == "error" and "LLaMA-Factory v1 config" in report.error


LF_FILES = ["lf_lora_sft.yaml", "lf_qlora_ds_z3.yaml", "lf_inference.yaml", "lf_merge.yaml", "lf_string_disable.yaml"]


@pytest.mark.skipif(not importable("llamafactory"), reason="LLaMA-Factory is not installed here (it is no dependency)")
def test_llamafactorys_own_parser_reads_what_the_model_reads(tmp_path):
    paths = [str(DATA / name) for name in LF_FILES]
    cwd = os.getcwd()
    os.chdir(tmp_path)  # LLaMA-Factory refuses an existing, non-empty output_dir: parse where there is none
    try:
        model = check_files(paths, Launch(parser="model", nproc=2))
        native = check_files(paths, Launch(parser="launcher", nproc=2, timeout=300))
    finally:
        os.chdir(cwd)
    for a, b in zip(model, native, strict=True):
        assert b.status != "error", b.error
        assert "own get_" in b.parser, b.parser
        assert a.facts == b.facts, a.path
        assert [d.to_dict() for d in a.decisions] == [d.to_dict() for d in b.decisions]
        assert not [n for n in b.notes if "LLaMA-Factory parsed" in n or ("default" in n and "differs" in n)]


def test_a_transformers_release_outside_llamafactorys_range_says_where_the_version_came_from(tmp_path):
    # the release given with --transformers-version is said as the option's, not as the installed one
    report = check(tmp_path, LF, versions=(("transformers", "4.50.0"),))
    (given,) = [d for d in report.decisions if d.rule_id == "llamafactory:transformers-range"]
    assert (given.before, given.source) == ("4.50.0", "option")
    # without the option, the installed release is checked and said as installed where it is outside the range
    installed = [d for d in check(tmp_path, LF).decisions if d.rule_id == "llamafactory:transformers-range"]
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    outside = not ((4, 55) <= (major, minor) <= (5, 8))
    assert [(d.before, d.source) for d in installed] == ([(transformers.__version__, "installed")] if outside else [])


HP = LF.replace("stage: sft\n", "stage: sft\nfinetuning_type: full\nuse_hyper_parallel: true\n")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hyperparallels_own_activation_mode_owns_checkpointing_and_the_check_stands_back(tmp_path, mode):
    (tmp_path / "hp.json").write_text(json.dumps({"tp_size": 2, "activation_mode": mode}))
    report = check(tmp_path, HP + "hyper_parallel_args: hp.json\nuse_reentrant_gc: false\n")
    assert (report.facts.gc_enabled, report.facts.use_reentrant) == (False, None)
    assert "disable_gradient_checkpointing" in report.sources["gc_enabled"].detail
    assert "llamafactory:hyper-parallel-owns-checkpointing" in rules(report, "none")
    assert "llamafactory:reentrant-default" not in rules(report) and report.status == "ok"
    # The same file without HyperParallel: LLaMA-Factory's own checkpointing, read as before.
    report = check(tmp_path, LF + "finetuning_type: full\nhyper_parallel_args: hp.json\n")
    assert report.facts.gc_enabled is True and "llamafactory:hyper-parallel-owns-checkpointing" not in rules(report)


def test_hyperparallel_without_an_activation_mode_keeps_llamafactorys_checkpointing(tmp_path):
    (tmp_path / "hp.json").write_text('{"tp_size": 2}')
    for text in (HP, HP + "hyper_parallel_args: hp.json\n"):
        report = check(tmp_path, text)
        assert (report.facts.gc_enabled, report.facts.use_reentrant) == (True, True)
        assert any("LLaMA-Factory's own checkpointing stays" in n for n in report.notes)
    report = check(tmp_path, HP.replace("stage: sft", "stage: dpo") + "hyper_parallel_args: hp.json\n")
    assert any("ignored for stage dpo" in n for n in report.notes)


def test_hyperparallel_args_the_check_cannot_read_are_never_ok(tmp_path):
    report = check(tmp_path, HP + "hyper_parallel_args: missing/hp.json\n")
    assert "llamafactory:hyper-parallel-args-unread" in rules(report, "warn")
    assert report.status == "incomplete" and report.exit_code == 2
    assert any("activation_mode is unknown" in what for what in report.unread)


def test_the_workers_environment_finds_this_copy_of_the_package(tmp_path):
    """The launchers' own parsers run in `python -m trl_gc_plugin.configcheck.read._worker` with `clean_environment()`:
    its PYTHONPATH must name the folder that holds the package (a checkout run without an install). `-S`: no
    site-packages, so only that PYTHONPATH can find it."""
    import subprocess
    import sys

    import trl_gc_plugin
    from trl_gc_plugin.configcheck.read.native import clean_environment

    code = "import importlib.util; print(importlib.util.find_spec('trl_gc_plugin.configcheck.read._worker').origin)"
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], env=clean_environment(), cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).parent.parent.parent == Path(trl_gc_plugin.__file__).parent
