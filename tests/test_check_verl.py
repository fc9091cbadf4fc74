"""`trl-gc-check` on verl launches (issue 44): `python3 -m verl.trainer.main_ppo` / `torchrun -m
verl.trainer.sft_trainer` commands with Hydra overrides (mostly assembled in bash arrays) and verl YAML configs, read
by the plugin's model of verl 1dda039; each verl rule on the shape that triggers it. Before the reader, every script
here was refused with a false "no OpenRLHF entry point"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trl_gc_plugin.configcheck.check import Launch, check_files
from trl_gc_plugin.configcheck.read import shell

pytestmark = pytest.mark.line_independent

DATA = Path(__file__).with_name("data")


def check(path, **launch):
    (report,) = check_files([str(path)], Launch(parser="model", **launch))
    return report


def write(tmp_path, text, name="run.sh"):
    path = tmp_path / name
    path.write_text(text)
    return path


def rules(report):
    return {d.rule_id: d.action for d in report.decisions}


def run(overrides, prelude=""):
    return f"{prelude}python3 -m verl.trainer.main_ppo \\\n    " + " \\\n    ".join(overrides) + "\n"


def test_verls_array_launcher_is_read_in_full():
    """The shape of verl's example launchers: arrays, `${VAR:-default}`, an array set again in a branch (RAY),
    `"$@"` (unread: it may hold any override; read as none with --no-script-args). The MoE name (gpt-oss) on FSDP
    on FSDP2 with checkpointing on is the MoE rule's warning, not a refusal."""
    as_written = check(DATA / "verl_grpo_arrays.sh")
    assert as_written.status == "incomplete" and [u.split(":")[0] for u in as_written.unread] == ['"$@"']
    report = check(DATA / "verl_grpo_arrays.sh", no_script_args=True)
    assert report.format == "verl" and report.status == "ok", report.error or report.unread
    got = report.to_dict()["facts"]
    assert got["gc_enabled"] is True and got["use_reentrant"] is False and got["fsdp_version"] == 2
    assert got["world_size"] == 8 and got["trainer_kind"] == "ppo" and got["generates"] is True
    assert report.sources["strategy"].value == "fsdp2" and report.sources["moe"].value is True
    assert rules(report)["verl:moe-fsdp2-checkpointing"] == "warn"
    assert any('"${RAY[@]}": set in a branch' in n for n in report.notes)
    assert any('"$@"' in n and "read as none (--no-script-args)" in n for n in report.notes)
    assert "7016" in json.dumps(report.to_dict()["decisions"])  # the source is in the evidence


def test_a_value_in_an_array_element_with_spaces_stays_one_word(tmp_path):
    """`data.train_files="$train_files"` with `train_files="['$HOME/a', '$HOME/b']"`: one override (it was split at
    the space, and a half of it read as a word that may hold any override)."""
    found, _ = shell.commands((DATA / "verl_grpo_arrays.sh").read_text(), "verl", str(DATA))
    words = [shell.readable(w) for w in found[-1].words]
    assert "data.train_files=['<unread>/data/gsm8k/train.parquet', '<unread>/data/math/train.parquet']" in words


def test_a_yaml_config_ulysses_fsdp2_is_refused():
    report = check(DATA / "verl_ppo.yaml")
    assert report.format == "verl" and report.status == "refused"
    assert rules(report)["verl:ulysses-fsdp2-checkpointing"] == "error"
    assert report.change.startswith("set actor_rollout_ref.actor.strategy=fsdp (engine.strategy=fsdp for sft_trainer)")
    assert report.facts.world_size == 16 and report.facts.fsdp_version == 2


def test_sft_under_torchrun_with_lora_in_a_branch_is_incomplete_not_ok():
    """`extra_args+=(model.lora_rank=32 ...)` inside an `if`: LoRA or not is known only when the script runs."""
    report = check(DATA / "verl_sft_torchrun.sh")
    assert report.status == "incomplete" and report.facts.trainer_kind == "sft"
    assert report.facts.world_size == 4
    assert any("extra_args" in u for u in report.unread)
    report = check(DATA / "verl_sft_torchrun.sh", nproc=4)
    assert report.status == "incomplete"  # the process count was never what was missing


def test_ulysses_without_fsdp2_or_with_verls_offloader_is_not_refused(tmp_path):
    base = ["actor_rollout_ref.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    fsdp1 = check(write(tmp_path, run(base)))
    assert fsdp1.status == "ok" and "verl:ulysses-fsdp2-checkpointing" not in rules(fsdp1)
    offload = check(
        write(
            tmp_path,
            run(
                [
                    *base,
                    "actor_rollout_ref.actor.strategy=fsdp2",
                    "actor_rollout_ref.model.enable_activation_offload=True",
                ]
            ),
        )
    )
    # verl's offloader disables transformers' checkpointing and runs its own reentrant one: no metadata check
    assert "verl:ulysses-fsdp2-checkpointing" not in rules(offload)
    assert offload.facts.use_reentrant is True and any("stands back" in n for n in offload.notes)
    refused = check(write(tmp_path, run([*base, "actor_rollout_ref.actor.strategy=fsdp2"])))
    assert refused.status == "refused"


@pytest.mark.parametrize(
    ("override", "rule", "action", "status"),
    [
        (
            "actor_rollout_ref.model.enable_activation_offloading=True",
            "verl:misspelled-key-refused",
            "error",
            "refused",
        ),
        ("+actor_rollout_ref.model.enable_activation_offloading=True", "verl:misspelled-key-ignored", "warn", "ok"),
        ("++critic.model.enable_gradient_checkpoint=False", "verl:misspelled-key-ignored", "warn", "ok"),
    ],
)
def test_a_misspelled_checkpointing_key_is_named_with_the_key_verl_reads(tmp_path, override, rule, action, status):
    report = check(write(tmp_path, run(["actor_rollout_ref.model.path=Qwen/Qwen3-8B", override])))
    assert rules(report)[rule] == action and report.status == status
    said = next(n for n in report.notes if "verl reads" in n)
    assert said.split("verl reads ")[1] in (
        "actor_rollout_ref.model.enable_activation_offload",
        "critic.model.enable_gradient_checkpointing",
    )


def test_verls_own_offload_and_checkpoint_keys_are_not_misspellings(tmp_path):
    report = check(
        write(
            tmp_path,
            run(
                [
                    "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
                    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                    "actor_rollout_ref.actor.checkpoint.save_contents=[model]",
                    "actor_rollout_ref.actor.entropy_checkpointing=True",
                ]
            ),
        )
    )
    assert report.status == "ok" and not any(r.startswith("verl:misspelled") for r in rules(report))


def test_offload_without_checkpointing_is_warned(tmp_path):
    on = ["actor_rollout_ref.model.path=Qwen/Qwen3-8B", "actor_rollout_ref.model.enable_activation_offload=True"]
    report = check(write(tmp_path, run([*on, "actor_rollout_ref.model.enable_gradient_checkpointing=False"])))
    assert rules(report)["verl:offload-without-checkpointing"] == "warn"
    assert "10157" in json.dumps(report.to_dict()["decisions"])
    with_gc = check(write(tmp_path, run(on)))
    assert "verl:offload-without-checkpointing" not in rules(with_gc)


def test_megatron_checkpointing_asked_without_recompute_is_warned(tmp_path):
    asked = [
        "--config-name=ppo_megatron_trainer",
        "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    ]
    report = check(write(tmp_path, run(asked)))
    assert report.sources["strategy"].value == "megatron" and report.facts.gc_enabled is False
    assert rules(report)["verl:megatron-recompute-not-applied"] == "warn"
    recompute = "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full"
    assert "verl:megatron-recompute-not-applied" not in rules(check(write(tmp_path, run([*asked, recompute]))))
    by_engine = check(write(tmp_path, run(["model_engine=megatron", *asked[1:]])))
    assert rules(by_engine)["verl:megatron-recompute-not-applied"] == "warn"
    unasked = check(write(tmp_path, run(["model_engine=megatron", asked[1]])))  # verl's default, not asked for
    assert "verl:megatron-recompute-not-applied" not in rules(unasked)


def test_trl_gc_plugin_exported_but_not_passed_to_the_ray_workers(tmp_path):
    base = ["actor_rollout_ref.model.path=Qwen/Qwen3-8B"]
    report = check(write(tmp_path, run(base, prelude="export TRL_GC_PLUGIN=1\n")))
    assert rules(report)["verl:plugin-not-in-ray-workers"] == "warn"
    assert "+ray_kwargs.ray_init.runtime_env.env_vars.TRL_GC_PLUGIN=1" in json.dumps(report.to_dict())
    passed = check(
        write(
            tmp_path,
            run(
                [*base, "+ray_kwargs.ray_init.runtime_env.env_vars.TRL_GC_PLUGIN=1"], prelude="export TRL_GC_PLUGIN=1\n"
            ),
        )
    )
    assert "verl:plugin-not-in-ray-workers" not in rules(passed)
    assert any("reaches the Ray workers" in n for n in passed.notes)
    inline = check(write(tmp_path, "TRL_GC_PLUGIN=1 " + run(base)))
    assert rules(inline)["verl:plugin-not-in-ray-workers"] == "warn"


def test_moe_from_a_local_config_and_a_dense_model(tmp_path):
    """The MoE rule is FSDP2's (verl #7016: FSDP1 trains the same config)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    fsdp2 = "actor_rollout_ref.actor.strategy=fsdp2"
    moe = check(write(tmp_path, run([f"actor_rollout_ref.model.path={model}", fsdp2])))
    assert moe.sources["moe"].origin == "model config" and rules(moe)["verl:moe-fsdp2-checkpointing"] == "warn"
    assert "strategy=fsdp " in rules_change(moe)
    fsdp1 = check(write(tmp_path, run([f"actor_rollout_ref.model.path={model}"])))
    assert fsdp1.sources["moe"].value is True and "verl:moe-fsdp2-checkpointing" not in rules(fsdp1)
    off = check(
        write(
            tmp_path,
            run(
                [
                    f"actor_rollout_ref.model.path={model}",
                    fsdp2,
                    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
                ]
            ),
        )
    )
    assert "verl:moe-fsdp2-checkpointing" not in rules(off)
    dense = check(write(tmp_path, run(["actor_rollout_ref.model.path=Qwen/Qwen3-8B", fsdp2])))
    assert dense.sources["moe"].value is False and dense.status == "ok"
    assert "verl:moe-fsdp2-checkpointing" not in rules(dense)


def rules_change(report) -> str:
    from trl_gc_plugin.configcheck.launchers import verl

    return " ".join(r.change for r in verl.RULES if r.id in rules(report)) + " "


@pytest.mark.parametrize(
    ("text", "unread"),
    [
        (run(["actor_rollout_ref.model.enable_gradient_checkpointing=${GC}"]), "enable_gradient_checkpointing: ${GC}"),
        (run(["actor_rollout_ref.model.path=Qwen/Qwen3-8B", '"${EXTRA[@]}"']), '"${EXTRA[@]}"'),
        # MoE or not decides the FSDP2 rule
        (
            run(["actor_rollout_ref.model.path=${MODEL}", "actor_rollout_ref.actor.strategy=fsdp2"]),
            "actor_rollout_ref.model.path: ${MODEL}",
        ),
        (run(["actor_rollout_ref.model.path=Qwen/Qwen3-8B", "$OVERRIDES"]), "$OVERRIDES"),
    ],
)
def test_what_the_verdict_depends_on_and_was_not_read_makes_it_incomplete(tmp_path, text, unread):
    report = check(write(tmp_path, text))
    assert report.status == "incomplete" and any(unread in u for u in report.unread), report.unread


def test_an_unread_model_path_on_fsdp1_decides_nothing(tmp_path):
    report = check(write(tmp_path, run(["actor_rollout_ref.model.path=${MODEL}"])))
    assert report.status == "ok" and any("${MODEL}" in n and "no rule reads it" in n for n in report.notes)


def test_a_model_named_after_an_unread_directory_is_judged_by_its_name(tmp_path):
    report = check(write(tmp_path, run(["actor_rollout_ref.model.path=$HOME/models/Qwen3-30B-A3B"])))
    assert report.status == "ok" and report.sources["moe"].value is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("docker run --gpus all -it verl:latest bash\n", "no OpenRLHF entry point"),
        ("python3 -m verl.model_merger merge --backend fsdp\n", None),
        (
            "$COMMAND data.train_files=a trainer.default_local_dir=~/verl/ckpt model.path=b engine=fsdp\n",
            "known only when",
        ),
        ("python3 -m verl.trainer.main_ppo\npython3 -m verl.trainer.sft_trainer\n", "several verl commands"),
        (run(["actor_rollout_ref.model.lora_rank=sixteen"]), "whole number"),
        (run(["actor_rollout_ref.model.enable_gradient_checkpointing=maybe"]), "boolean"),
    ],
)
def test_scripts_that_are_no_verl_training_launch_say_why(tmp_path, text, message):
    report = check(write(tmp_path, text))
    if message is None:  # verl's merger trains nothing: no false "no entry point"
        assert report.format == "verl" and report.status == "ok" and report.training is False
    else:
        assert report.status == "error" and message in report.error, report.error
        assert "internal error" not in report.error


def test_the_verl_rules_are_data_with_their_sources():
    from trl_gc_plugin.configcheck.launchers import verl

    for rule in verl.RULES:
        assert rule.id.startswith("verl:") and rule.condition and rule.message and rule.remove_when
        assert rule.evidence and all("https://" in e or e.startswith("trl_gc_plugin/") for e in rule.evidence)


def test_no_script_args_reads_a_scripts_arguments_as_none_for_openrlhf_too(tmp_path):
    text = 'deepspeed --module openrlhf.cli.train_sft --pretrain x --model.gradient_checkpointing_enable "$@"\n'
    assert check(write(tmp_path, text)).status == "incomplete"
    report = check(write(tmp_path, text), no_script_args=True)
    assert report.status == "ok" and any("--no-script-args" in n for n in report.notes)


def test_the_command_line_option(capsys):
    from trl_gc_plugin.cli.check import check_main

    path = str(DATA / "verl_grpo_arrays.sh")
    assert check_main(["--parser", "model", "--brief", path]) == 2
    assert check_main(["--parser", "model", "--brief", "--no-script-args", path]) == 0
    out = capsys.readouterr().out
    assert "incomplete: could not be read: \"$@\"" in out and "[verl:moe-fsdp2-checkpointing] warn" in out


def test_a_forced_format_that_is_not_the_commands_is_refused_and_verl_on_another_yaml_is_not_ok(tmp_path):
    script = write(tmp_path, run(["actor_rollout_ref.model.path=Qwen/Qwen3-8B"]))
    for forced in ("openrlhf", "trl"):
        report = check(script, format=forced)
        assert report.status == "error" and "runs a verl command" in report.error, report.error
    assert check(script, format="verl").status == "ok"
    other = check(DATA / "trl_sft_lora.yaml", format="verl")
    assert other.status == "incomplete" and "nothing of a verl launch was read" in other.unread[0]


@pytest.mark.parametrize("lora", [False, True])
def test_the_check_and_the_run_agree(tmp_path, lora):
    """One process: the check of a verl launch and the model route on a loop that makes verl's FSDP engine calls
    (`{"use_reentrant": False}`, LoRA after `enable_input_require_grads()`) take the same decisions."""
    import torch

    import trl_gc_plugin
    from trl_gc_plugin.testing import make_model

    overrides = ["actor_rollout_ref.model.path=Qwen/Qwen3-8B", "trainer.n_gpus_per_node=1"]
    overrides += ["actor_rollout_ref.model.lora_rank=4"] if lora else []
    report = check(write(tmp_path, run(overrides)))
    checked = {(d.rule_id, d.action, d.after) for d in report.decisions if ":" not in d.rule_id}
    with trl_gc_plugin.installed():
        model = make_model()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            from peft import LoraConfig, get_peft_model

            model.enable_input_require_grads()
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        model.train()
        ids = torch.randint(3, 64, (2, 8))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        route = trl_gc_plugin.routes.model_route._ROUTES.get(trl_gc_plugin.model.ckpt.unwrap(model))
        ran = {(d.rule_id, d.action, d.after) for d in route.run.decisions if d.stage == "init_end"}
        route.end()
    assert checked == ran, f"check {checked} run {ran}"
    assert ("non-reentrant-default", "none", False) in checked  # verl's kwargs kept as passed, on both sides


@pytest.mark.parametrize(
    ("flags", "status"),
    [
        ("--config-path=config --config-name=ppo_megatron_trainer", "ok"),  # verl's own, beside the entry
        ("--config-name='ppo_megatron_trainer.yaml'", "ok"),
        ("--config-path=/srv/my_configs --config-name=my_ppo", "incomplete"),
        ("--config-name=my_ppo", "incomplete"),
    ],
)
def test_a_config_of_ones_own_is_unread(tmp_path, flags, status):
    report = check(write(tmp_path, run([flags, "actor_rollout_ref.model.path=Qwen/Qwen3-8B"])))
    assert report.status == status, report.unread
    if status == "ok":
        assert report.sources["strategy"].value == "megatron"


def test_a_ray_job_runtime_env_that_passes_the_variable(tmp_path):
    submit = "export TRL_GC_PLUGIN=1\nray job submit --runtime-env-json='{\"env_vars\": {\"TRL_GC_PLUGIN\": \"1\"}}' -- "
    report = check(write(tmp_path, submit + run(["actor_rollout_ref.model.path=Qwen/Qwen3-8B"])))
    assert report.format == "verl" and "verl:plugin-not-in-ray-workers" not in rules(report)
    other = submit.replace('"TRL_GC_PLUGIN": "1"', '"X": "1"')
    assert rules(check(write(tmp_path, other + run(["actor_rollout_ref.model.path=Qwen/Qwen3-8B"]))))[
        "verl:plugin-not-in-ray-workers"
    ] == "warn"
