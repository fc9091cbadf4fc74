"""`trl-gc-check` on OpenRLHF command lines (issue 27): a shell script or text file holding `openrlhf.cli.train_*` and its
flags, OpenRLHF 0.11.2's dotted flags and the flat flags of <= 0.9; and the check agrees with the run's model route on
a loop that makes OpenRLHF's own enable call."""

from __future__ import annotations

import textwrap

import pytest
import torch

import trl_gc_plugin
from trl_gc_plugin.configcheck.check import Launch, check_files
from trl_gc_plugin.configcheck.launchers.common import ConfigError
from trl_gc_plugin.configcheck.launchers.load import load
from trl_gc_plugin.configcheck.launchers.openrlhf import parse_command
from trl_gc_plugin.testing import make_model

SCRIPT = """\
set -x
read -r -d '' training_commands <<EOF
openrlhf.cli.train_sft \\
   --data.max_len 2048 \\
   --model.model_name_or_path meta-llama/Meta-Llama-3-8B \\
   --ds.zero_stage 3 {extra} \\
   --model.gradient_checkpointing_enable
EOF
    # --model.gradient_checkpointing_reentrant

if [[ ${{1}} != "slurm" ]]; then
    deepspeed --num_gpus 8 --module $training_commands
fi
"""


def write(tmp_path, text, name="train.sh"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def facts(report):
    return report.to_dict()["facts"]


def test_a_script_in_openrlhfs_own_style(tmp_path):
    path = write(tmp_path, SCRIPT.format(extra="--ds.lora.rank 16"))
    (report,) = check_files([path], Launch(parser="model", versions=(("deepspeed", "0.19.8"),)))
    got = facts(report)
    assert report.format == "openrlhf" and report.status == "ok"
    assert got["gc_enabled"] is True and got["use_reentrant"] is False  # OpenRLHF passes the flag's default
    assert got["zero_stage"] == 3 and got["world_size"] == 8 and got["is_peft"] is True
    assert got["inputs_require_grad"] is True  # OpenRLHF's Actor calls enable_input_require_grads() before LoRA
    assert got["trainer_kind"] == "sft"


def test_old_deepspeed_zero3_lora_non_reentrant_is_refused_with_openrlhfs_flag(tmp_path):
    """The `zero3-frozen-needs-reentrant` rule (DeepSpeed < 0.19.3): the change line is OpenRLHF's switch."""
    path = write(tmp_path, SCRIPT.format(extra="--ds.lora.rank 16"))
    (report,) = check_files([path], Launch(parser="model", versions=(("deepspeed", "0.15.0"),)))
    assert report.status == "refused"
    assert report.change == "add --model.gradient_checkpointing_reentrant"


def test_flat_flags_of_older_openrlhf_and_a_one_line_command(tmp_path):
    text = ("deepspeed --module openrlhf.cli.train_dpo --pretrain ./model --zero_stage 2 --gradient_checkpointing "
            "--gradient_checkpointing_use_reentrant --lora_rank 8 --load_in_4bit\n")
    (report,) = check_files([write(tmp_path, text, "cmd.txt")], Launch(parser="model", nproc=4))
    got = facts(report)
    assert got["use_reentrant"] is True and got["zero_stage"] == 2 and got["world_size"] == 4
    assert got["quantization"] == "bitsandbytes_4bit" and got["trainer_kind"] == "dpo" and got["rl_trainer"]


def test_ppo_reads_the_actor_flags(tmp_path):
    text = ("ray job submit -- python3 -m openrlhf.cli.train_ppo_ray --actor.num_nodes 2 "
            "--actor.num_gpus_per_node 8 --actor.gradient_checkpointing_enable --ds.zero_stage 3\n")
    (report,) = check_files([write(tmp_path, text)], Launch(parser="model"))
    got = facts(report)
    assert got["gc_enabled"] is True and got["world_size"] == 16 and got["generates"] is True
    assert "critic" in report.sources["gc_enabled"].detail


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("python -m openrlhf.cli.train_sft --ds.zero_stage three\n", "whole number"),
        ("python -m openrlhf.cli.train_sft --model.gradient_checkpointing_enable yes\n", "takes no value"),
        ("python -m openrlhf.cli.train_sft 'unclosed\n", "cannot split"),
        ("python -m openrlhf.cli.train_sft\npython -m openrlhf.cli.train_dpo\n", "several OpenRLHF commands"),
    ],
)
def test_malformed_commands_are_named(tmp_path, text, message):
    (report,) = check_files([write(tmp_path, text)], Launch(parser="model"))
    assert report.status == "error" and message in report.error


def test_a_yaml_that_mentions_openrlhf_is_still_yaml(tmp_path):
    path = write(tmp_path, "# launched like openrlhf.cli.train_sft\nmodel_name_or_path: x\n", "cfg.yaml")
    assert load(path).kind == "yaml"
    with pytest.raises(ConfigError):
        parse_command(path, "no entry point here")


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_the_check_and_the_run_agree(tmp_path, reentrant, lora):
    """One process, no DeepSpeed: the check of the command and the model route on a loop that makes OpenRLHF's own
    enable call (`{"use_reentrant": <flag>}`, LoRA after `enable_input_require_grads()`) take the same decisions."""
    flags = " --model.gradient_checkpointing_enable" + (" --model.gradient_checkpointing_reentrant" if reentrant else "")
    flags += " --ds.lora.rank 4" if lora else ""
    (report,) = check_files([write(tmp_path, f"python -m openrlhf.cli.train_sft{flags} --ds.zero_stage 0\n")],
                            Launch(parser="model"))
    checked = {(d["rule_id"], d["action"], d["after"]) for d in report.to_dict()["decisions"]}
    model = make_model()
    if lora:
        from peft import LoraConfig, get_peft_model

        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with trl_gc_plugin.installed():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        ids = torch.randint(3, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        route = trl_gc_plugin.routes.model_route._ROUTES.get(trl_gc_plugin.model.ckpt.unwrap(model))
        ran = {(d.rule_id, d.action, d.after) for d in route.run.decisions if d.stage == "init_end"}
        route.end()
    assert checked == ran, textwrap.shorten(f"check {checked} run {ran}", 400)
