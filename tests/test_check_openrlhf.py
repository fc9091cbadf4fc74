"""`trl-gc-check` on OpenRLHF command lines (issue 27): a shell script or text file holding `openrlhf.cli.train_*` and its
flags, OpenRLHF 0.11.2's dotted flags and the flat flags of <= 0.9; and the check agrees with the run's model route on
a loop that makes OpenRLHF's own enable call."""

from __future__ import annotations

import textwrap

import pytest
import torch

import trl_gc_plugin
from trl_gc_plugin.configcheck.check import Launch, check_files
from trl_gc_plugin.configcheck.launchers.openrlhf import parse_command
from trl_gc_plugin.configcheck.read.common import ConfigError
from trl_gc_plugin.configcheck.read.load import load
from trl_gc_plugin.testing import make_model

pytestmark = pytest.mark.line_independent

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


# --- commands as bash builds them (issue 39) ---------------------------------------------------------------------

ARRAYS = """\
#!/bin/bash
SCRIPT_DIR="$(dirname "$0")"
WORK_DIR=$(cd "$SCRIPT_DIR/../.." && pwd)
MODEL_PATH="Qwen/Qwen3-4B"
SAVE_PATH="${{WORK_DIR}}/exp/run"

CKPT_ARGS=(
   --actor.model_name_or_path ${{MODEL_PATH}}
   # --reward.model_name_or_path ${{REWARD_MODEL}}
   --ckpt.output_dir ${{SAVE_PATH}}
)

ENGINE_ARGS=(
   --actor.num_nodes 1
   --actor.num_gpus_per_node 4
   --ds.zero_stage 3
   --actor.gradient_checkpointing_enable
   {extra}
)

ray job submit --address="http://127.0.0.1:8265" \\
   -- python3 -m openrlhf.cli.train_ppo_ray \\
   ${{CKPT_ARGS[@]}} \\
   ${{ENGINE_ARGS[@]}} {tail}
"""

QLORA = "--actor.gradient_checkpointing_reentrant\n   --ds.lora.rank 16\n   --ds.load_in_4bit"


def rules_of(report):
    return {d.rule_id: d.action for d in report.decisions}


def test_a_command_built_from_bash_arrays_is_read_as_bash_expands_it(tmp_path):
    """OpenRLHF's own example scripts build the command from arrays: read before as checkpointing off, ZeRO 2 and one
    process (the launcher defaults), and a QLoRA + reentrant command passed with exit 0."""
    (report,) = check_files([write(tmp_path, ARRAYS.format(extra="", tail=""))], Launch(parser="model"))
    got = facts(report)
    assert (got["gc_enabled"], got["zero_stage"], got["world_size"]) == (True, 3, 4), got
    assert report.status == "ok" and not report.unread
    assert any("--ckpt.output_dir" in note and "pwd" in note for note in report.notes)  # said, no rule reads it
    # the same command with QLoRA and reentrant in the array: refused, as the command written out is
    written = "python3 -m openrlhf.cli.train_ppo_ray --actor.num_nodes 1 --actor.num_gpus_per_node 4 --ds.zero_stage 3 " \
              "--actor.gradient_checkpointing_enable " + QLORA.replace("\n   ", " ") + "\n"
    # (the verdict depends on the DeepSpeed release: name one, as CI's environments differ in what they install)
    for deepspeed, rule in (("0.19.8", "distributed-rl-qlora-no-reentrant"), ("0.19.2", "conflict")):
        launch = Launch(parser="model", versions=(("deepspeed", deepspeed),))
        (out,) = check_files([write(tmp_path, written, "written.sh")], launch)
        (arrays,) = check_files([write(tmp_path, ARRAYS.format(extra=QLORA, tail=""))], launch)
        assert out.status == arrays.status == "refused"
        assert rules_of(arrays) == rules_of(out) == {rule: "error"}, (deepspeed, rules_of(arrays), rules_of(out))


def test_what_the_expansion_cannot_read_is_named_and_never_ok(tmp_path):
    # an array the script does not set may hold any flag
    (report,) = check_files([write(tmp_path, ARRAYS.format(extra="", tail="${EXTRA_ARGS[@]}"))], Launch(parser="model"))
    assert report.status == "incomplete" and report.exit_code == 2
    assert any("${EXTRA_ARGS[@]}" in what and "may hold any flag" in what for what in report.unread)
    # a flag the rules read, set from the environment
    (report,) = check_files([write(tmp_path, ARRAYS.format(extra="--ds.lora.rank $LORA_RANK", tail=""))],
                            Launch(parser="model"))
    assert report.status == "incomplete" and report.unread == ["--ds.lora.rank: $LORA_RANK: not set in the script (the environment's)"]
    # a refusal on what was read stands
    (report,) = check_files([write(tmp_path, ARRAYS.format(extra=QLORA, tail="${EXTRA_ARGS[@]}"))], Launch(parser="model"))
    assert report.status == "refused" and report.unread


def test_a_command_inside_srun_bash_c(tmp_path):
    script = textwrap.dedent('''\
        #!/bin/bash
        RAY_VERSION=2.12.0
        nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
        nodes_array=( $nodes )
        node_1=${nodes_array[0]}
        for ((i = 1; i < 3; i++)); do
        node_i=${nodes_array[$i]}
        done
        srun --overlap --nodes=1 --ntasks=1 -w "$node_1" bash -c \\
        "pip install ray[default]==$RAY_VERSION \\
        && ray job submit --address=http://localhost:8265 \\
            -- python3 -m openrlhf.cli.train_ppo_ray \\
            --actor.num_nodes 2 \\
            --actor.num_gpus_per_node 8 \\
            --ds.zero_stage 3 \\
            --actor.gradient_checkpointing_enable" &>> log
        ''')
    (report,) = check_files([write(tmp_path, script)], Launch(parser="model"))
    got = facts(report)
    assert report.status == "ok", report.error
    assert (got["gc_enabled"], got["zero_stage"], got["world_size"], got["trainer_kind"]) == (True, 3, 16, "ppo")


def test_check_help_names_openrlhf(capsys):
    from trl_gc_plugin.cli.check import check_main

    with pytest.raises(SystemExit):
        check_main(["--help"])
    out = capsys.readouterr().out
    assert "OpenRLHF" in out and "openrlhf" in out


def test_a_script_that_sources_the_command_from_another(tmp_path):
    """OpenRLHF's `train_nonrl_slurm.sh` shape: the flags come from a sourced script's heredoc, `echo $cmd` shows them
    (no run), and `torchrun -m ${cmd}` inside `srun bash -c "..." &>> log` runs them; the node count is the job's."""
    write(tmp_path, SCRIPT.format(extra=""), "train_dpo.sh")
    slurm = textwrap.dedent('''\
        readonly training_script="train_dpo.sh"
        readonly GPUS_PER_NODE=8
        source ./${training_script} slurm
        echo $training_commands &>> log
        srun --container-image="$IMAGE" bash -c " cd /openrlhf; torchrun \\
        --nproc_per_node $GPUS_PER_NODE --nnodes $SLURM_NNODES -m ${training_commands}" &>> ${JOBLOG}
        ''')
    (report,) = check_files([write(tmp_path, slurm, "slurm.sh")], Launch(parser="model"))
    got = facts(report)
    assert (got["gc_enabled"], got["zero_stage"], got["world_size"]) == (True, 3, 8)
    assert report.status == "incomplete" and any("$SLURM_NNODES" in what for what in report.unread)
    (report,) = check_files([str(tmp_path / "slurm.sh")], Launch(parser="model", nproc=16))
    assert report.status == "ok" and report.facts.world_size == 16
    # without the sourced script, the check says what it could not find
    (tmp_path / "train_dpo.sh").unlink()
    (report,) = check_files([str(tmp_path / "slurm.sh")], Launch(parser="model"))
    assert report.status == "error" and "sources ./train_dpo.sh, not found here" in report.error


def test_a_shell_script_without_an_openrlhf_command_is_not_read_as_yaml(tmp_path):
    (report,) = check_files([write(tmp_path, "docker run --gpus all -it nvcr.io/pytorch:26.03 bash\n", "run.sh")],
                            Launch(parser="model"))
    assert report.status == "error" and "no OpenRLHF entry point" in report.error


RUN = "deepspeed --module openrlhf.cli.train_sft --pretrain x "


@pytest.mark.parametrize(
    ("script", "unread"),
    [
        # a flag hidden where bash splits an unset variable into words, or in the script's arguments
        (RUN + "$EXTRA_ARGS\n", "$EXTRA_ARGS"),
        (RUN + '"$@"\n', '"$@"'),
        # which flag is not known
        (RUN + "--${P}gradient_checkpointing_enable\n", "${P}"),
        # set in one branch of an `if`: bash runs one
        (
            'if [ "$GC" = 1 ]; then\n  GCF=--model.gradient_checkpointing_enable\nelse\n  GCF=\nfi\n' + RUN + "$GCF\n",
            "$GCF: set inside a loop, a branch or a function",
        ),
        # two commands in two branches: the first was read, the other says otherwise
        (
            'if [ "$A" = 1 ]; then\n  '
            + RUN
            + "\nelse\n  "
            + RUN
            + "--model.gradient_checkpointing_enable --ds.zero_stage 3\nfi\n",
            "1 other command(s) run train_sft",
        ),
    ],
)
def test_flags_the_expansion_could_not_see_are_never_ok(tmp_path, script, unread):
    """Each of these read `ok` (checkpointing off, ZeRO 2) before: the unread value was dropped or taken as the
    previous flag's value."""
    (report,) = check_files([write(tmp_path, script)], Launch(parser="model"))
    assert report.status == "incomplete", (report.status, report.unread)
    assert any(unread in what for what in report.unread), report.unread


@pytest.mark.parametrize(
    "script",
    [
        "ARGS=(--model.gradient_checkpointing_enable --ds.zero_stage 3)\n" + RUN + '"${ARGS[@]}"\n',
        "CUDA_VISIBLE_DEVICES=0,1 " + RUN + "--model.gradient_checkpointing_enable --ds.zero_stage 3\n",
        "export A=1; " + RUN + "--model.gradient_checkpointing_enable --ds.zero_stage 3\n",
        "Z=3 GC=--model.gradient_checkpointing_enable\n" + RUN + "$GC --ds.zero_stage $Z\n",
        "f() {\n  echo hi\n}\nfor i in 1 2; do echo $i; done\nZ=3\n"
        + RUN
        + "--model.gradient_checkpointing_enable --ds.zero_stage $Z\n",
    ],
    ids=["quoted-array", "env-prefix", "export-then-command", "two-assignments", "after-a-function-and-a-loop"],
)
def test_shapes_bash_reads_plainly_are_read(tmp_path, script):
    """A quoted array expands to one word per element; `NAME=value command` runs the command (it was taken for an
    assignment: no command found); a function's `}` and a one-line loop close their blocks."""
    (report,) = check_files([write(tmp_path, script)], Launch(parser="model"))
    got = facts(report)
    assert report.status == "ok" and not report.unread, (report.status, report.unread)
    assert (got["gc_enabled"], got["zero_stage"]) == (True, 3), got
