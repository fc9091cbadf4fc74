"""`python -m trl_gc_plugin check` / `trl-gc-check`: exit codes, output, options, several files, `--json`.

Most tests run the CLI in this process with `--parser model` (the plugin's model of each launcher: no TRL import),
a few through `python -m` in a subprocess; `test_check_trl.py` runs TRL's own parser. The configs are in
`tests/data/` (written from each launcher's documented keys) or written here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trl_gc_plugin.cli.check import check_main
from trl_gc_plugin.cli.main import main
from trl_gc_plugin.core.decisions import Decision

DATA = Path(__file__).with_name("data")


def run_cli(*argv: str, entry: str = "check_main", capsys: pytest.CaptureFixture[str] | None = None) -> tuple[int, str, str]:
    """Run the check in this process; (exit code, stdout, stderr). A traceback fails the test (it would escape)."""
    assert capsys is not None
    capsys.readouterr()
    try:
        code = check_main(list(argv)) if entry == "check_main" else main(["check", *argv])
    except SystemExit as exc:  # argparse's own exit (usage errors, --help)
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def data(name: str) -> str:
    return str(DATA / name)


def model(*argv: str) -> tuple[str, ...]:
    return (*argv, "--parser", "model")


def test_a_plain_trl_lora_config_is_fine(capsys):
    code, out, err = run_cli(*model(data("trl_sft_lora.yaml"), "--transformers-version", "5.23.0"), capsys=capsys)
    assert code == 0 and err == ""
    assert "[non-reentrant-default] default: use_reentrant: None -> False" in out
    assert "verdict: fine" in out


def test_on_transformers_4_trl_writes_non_reentrant_itself(capsys):
    code, out, _ = run_cli(*model(data("trl_sft_lora.yaml"), "--transformers-version", "4.57.6"), capsys=capsys)
    assert code == 0
    assert "launcher rewrite: trl sft on transformers < 5: setdefault(use_reentrant=False)" in out
    assert "[non-reentrant-default] none: use_reentrant=False (set by trainer)" in out


@pytest.mark.parametrize(("nproc", "code"), [("1", 0), ("2", 1)])
def test_explicit_reentrant_with_lora_under_ddp(capsys, nproc, code):
    rc, out, _ = run_cli(*model(data("trl_sft_lora_reentrant.yaml"), "--nproc", nproc), capsys=capsys)
    assert rc == code
    assert ("[ddp-reentrant-find-unused] error" in out) is (code == 1)
    if code:
        assert "  change: set gradient_checkpointing_kwargs: {use_reentrant: false}\n" in out


def test_string_false_is_repaired_not_refused(capsys):
    code, out, _ = run_cli(*model(data("trl_string_false.json")), capsys=capsys)
    assert code == 0 and "[invalid-use-reentrant] repair: use_reentrant: 'false' -> False" in out


def test_fsdp_with_both_checkpointings(capsys):
    code, out, _ = run_cli(*model(data("trl_fsdp_both.yaml"), "--nproc", "2"), capsys=capsys)
    assert code == 1 and "[fsdp-activation-checkpointing] error" in out
    assert "change: set gradient_checkpointing: false" in out


@pytest.mark.parametrize(("deepspeed", "code"), [("0.19.2", 1), ("0.19.8", 0)])
def test_axolotl_qlora_zero3_depends_on_the_deepspeed_release(capsys, deepspeed, code):
    rc, out, _ = run_cli(*model(data("axolotl_qlora_zero3.yml"), "--nproc", "2", "--deepspeed-version", deepspeed), capsys=capsys)
    assert rc == code, out
    assert "DeepSpeed ZeRO stage                 3" in out
    assert ("[zero3-frozen-needs-reentrant] error" in out) is (code == 1)
    assert "[axolotl:qlora-zero3-warning]" in out  # Axolotl only warns; the plugin says why it decides otherwise
    assert "disagrees on purpose" in out


@pytest.mark.parametrize("transformers", ["4.57.6", "5.23.0"])
def test_axolotl_refuses_partially_frozen_with_reentrant_on_every_transformers(capsys, transformers):
    rc, out, _ = run_cli(*model(data("axolotl_unfrozen_reentrant.yml"), "--transformers-version", transformers), capsys=capsys)
    assert rc == 1, out
    assert "[axolotl:unfrozen-needs-non-reentrant] error" in out
    assert "change: gradient_checkpointing_kwargs: {use_reentrant: false}" in out


def test_axolotl_multi_gpu_rl_qlora_reentrant(capsys):
    assert run_cli(*model(data("axolotl_rl_qlora.yml"), "--nproc", "1"), capsys=capsys)[0] == 0
    code, out, _ = run_cli(*model(data("axolotl_rl_qlora.yml"), "--nproc", "2"), capsys=capsys)
    assert code == 1
    assert "[axolotl:distributed-rl-qlora-reentrant] error" in out  # Axolotl's own validator
    assert "[distributed-rl-qlora-no-reentrant] error" in out  # and the plugin's rule agree


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("malformed.yaml", "line 3, column 13"),
        ("bad_kwargs.yaml", "key 'gradient_checkpointing_kwargs' (line 2): expected a mapping"),
        ("does_not_exist.yaml", "cannot read: No such file or directory"),
        ("accelerate_fsdp2.yaml", "an accelerate launch config"),
        ("zero3.json", "a DeepSpeed config"),
    ],
)
def test_unreadable_configs_exit_2_and_say_where(capsys, name, message):
    code, out, err = run_cli(*model(data(name)), capsys=capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_console_script_is_declared():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'trl-gc-check = "trl_gc_plugin.cli.check:check_main"' in text


def test_several_files_in_one_call_with_a_summary(capsys):
    files = [data("trl_sft_lora.yaml"), data("trl_fsdp_both.yaml"), data("malformed.yaml"), data("lf_inference.yaml")]
    code, out, err = run_cli(*model(*files), capsys=capsys)
    assert code == 2  # the worst: one file could not be checked
    assert out.rstrip().splitlines()[-1] == "checked 4 file(s): 2 fine, 1 refused, 1 not checked (unreadable, unrecognised or invalid)"
    assert err.count("\n") == 1 and "malformed.yaml: line 3" in err
    code, out, _ = run_cli(*model(files[0], files[1]), capsys=capsys)
    assert code == 1 and "checked 2 file(s): 1 fine, 1 refused" in out


def test_json_output_per_file(capsys):
    files = [data("trl_sft_lora_reentrant.yaml"), data("axolotl_sft_lora.yml"), data("bad_kwargs.yaml")]
    code, out, err = run_cli(*model(*files, "--nproc", "2", "--json"), capsys=capsys)
    assert code == 2 and "bad_kwargs.yaml" in err
    items = json.loads(out)
    assert [item["path"] for item in items] == files
    assert [item["exit_code"] for item in items] == [1, 0, 2]
    trl_item, axolotl_item, bad = items
    assert trl_item["format"] == "trl" and trl_item["status"] == "refused"
    assert trl_item["facts"]["world_size"] == 2 and trl_item["sources"]["world_size"] == {"value": 2, "origin": "option", "detail": "--nproc"}
    assert trl_item["change"] == "set gradient_checkpointing_kwargs: {use_reentrant: false}"
    decisions = [Decision.from_dict(d) for d in trl_item["decisions"]]
    assert any(d.rule_id == "ddp-reentrant-find-unused" and d.action == "error" for d in decisions)
    assert axolotl_item["sources"]["use_reentrant"]["origin"] == "launcher rewrite"
    assert axolotl_item["sources"]["ddp_find_unused_parameters"]["value"] is False
    assert bad["status"] == "error" and "expected a mapping" in bad["error"] and bad["facts"] is None


def test_every_fact_says_where_it_came_from(capsys):
    code, out, _ = run_cli(*model(data("trl_zero3_accelerate.yaml"), "--json"), capsys=capsys)
    assert code == 0
    (item,) = json.loads(out)
    origins = {name: source["origin"] for name, source in item["sources"].items()}
    assert origins["gc_enabled"] == "launcher default"  # TRL's configs default it to True
    assert origins["world_size"] == "file"  # num_processes: 4
    assert origins["zero_stage"] == "accelerate config"  # accelerate_config: zero3
    assert origins["use_reentrant"] == "launcher rewrite"  # TRL's trainer: PEFT + ZeRO-3
    assert origins["versions.transformers"] == "installed"
    assert set(origins.values()) <= {"file", "launcher default", "launcher rewrite", "accelerate config", "deepspeed config", "option", "installed", "assumed"}


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (("--nproc", "-3"), "--nproc -3: expected a whole number of processes >= 1"),
        (("--nproc", "0"), "--nproc 0"),
        (("--nproc", "two"), "--nproc 'two'"),
        (("--deepspeed-version", "latest"), "--deepspeed-version 'latest': not a version number"),
        (("--transformers-version", "foo"), "--transformers-version 'foo': not a version number"),
        (("--trainer", "foo"), "--trainer 'foo': not a trainer TRL has"),
        (("--mode", "loose"), "--mode 'loose': mode accepts strict, fix or warn (any case)"),
        (("--format", "yaml"), "--format 'yaml'"),
        (("--parser", "fast"), "--parser 'fast'"),
        (("--timeout", "0"), "--timeout '0'"),
        (("--timeout", "nan"), "--timeout 'nan'"),
        (("--accelerate-config", "no/such/file.yaml"), "--accelerate-config 'no/such/file.yaml'"),
        (("--no-such-option",), "unrecognized arguments: --no-such-option"),
    ],
)
@pytest.mark.parametrize("entry", ["check_main", "main"])
def test_invalid_options_exit_2_with_one_line(capsys, option, message, entry):
    code, out, err = run_cli(data("trl_sft_lora.yaml"), *option, entry=entry, capsys=capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_no_config_given_is_a_usage_error(capsys):
    code, _, err = run_cli(entry="check_main", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and "CONFIG" in err


def test_trl_config_with_a_trainer_the_trl_cli_does_not_have(capsys):
    code, _, err = run_cli(*model(data("trl_sft_lora.yaml"), "--trainer", "orpo"), capsys=capsys)
    assert code == 2 and "TRL's CLI has no `trl orpo` command" in err


def test_mode_and_trainer_have_help(capsys):
    code, out, _ = run_cli("--help", capsys=capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "--mode MODE the plugin's mode to decide for: strict (a setup known to break training is refused)" in text
    assert "default: $TRL_GC_PLUGIN_MODE as the run reads it, else strict" in text
    assert "--trainer KIND the trainer a TRL config is for, one of TRL's: distillation, dpo, grpo, kto, reward, rloo, sft" in text
    assert "Exit status: 0 every file fine; 1" in text


@pytest.mark.parametrize(("mode", "action"), [("strict", "error"), ("fix", "override"), ("warn", "warn")])
def test_mode_changes_the_verdict(capsys, mode, action):
    code, out, _ = run_cli(*model(data("trl_sft_lora_reentrant.yaml"), "--nproc", "2", "--mode", mode), capsys=capsys)
    assert code == (1 if mode == "strict" else 0)
    assert f"[ddp-reentrant-find-unused] {action}" in out


def test_unknown_deepspeed_release_is_assumed_old_and_said(capsys, monkeypatch):
    from trl_gc_plugin.configcheck import check as check_module

    real = dict(check_module.installed_versions())
    monkeypatch.setattr(check_module, "installed_versions", lambda: {**real, "deepspeed": None})
    code, out, _ = run_cli(*model(data("axolotl_qlora_zero3.yml"), "--nproc", "2"), capsys=capsys)
    assert code == 1  # as on DeepSpeed 0.9.3: ZeRO-3 + QLoRA needs reentrant; the file says false
    assert "deepspeed                            0.9.3             assumed: not installed here and no --deepspeed-version" in out
    assert "[zero3-frozen-needs-reentrant] error" in out
    code, out, _ = run_cli(*model(data("trl_sft_lora.yaml")), capsys=capsys)
    assert "deepspeed                            -                 installed: not installed here" in out  # not used: not assumed


def test_no_traceback_through_python_m(tmp_path):
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(bytes(range(256)) * 64)
    proc = subprocess.run(
        [sys.executable, "-m", "trl_gc_plugin", "check", str(binary), data("trl_sft_lora.yaml"), "--parser", "model"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {binary}: not a UTF-8 text file (it holds NUL bytes: binary, or UTF-16/UTF-32 text); save the config as UTF-8"]
    assert "checked 2 file(s): 1 fine, 0 refused, 1 not checked" in proc.stdout


@pytest.mark.parametrize(("value", "static_graph"), [('"maybe"', True), ('"false"', True), ("false", False)])
def test_a_plain_arguments_file_reads_ddp_keys_as_transformers_does(capsys, tmp_path, value, static_graph):
    # parse_json_file converts no string: a quoted value is kept (a non-empty one counts as true) and said; TRL's
    # boolean parsing (which refuses "maybe") is not the one that reads a TrainingArguments file
    path = tmp_path / "args.json"
    path.write_text(f'{{"output_dir": "x", "gradient_checkpointing": true, "ddp_static_graph": {value}}}')
    code, out, err = run_cli(*model(str(path), "--json", "--format", "training-args"), capsys=capsys)
    (report,) = json.loads(out)
    assert code == 0 and err == ""
    assert report["facts"]["ddp_static_graph"] is static_graph
    warned = [d["before"] for d in report["decisions"] if d["rule_id"] == "training-args:string-boolean"]
    assert warned == ([["ddp_static_graph"]] if value.startswith('"') else [])


# --- the pre-commit hook (issue 39) ------------------------------------------------------------------------------


def test_the_pre_commit_hook_runs_the_check_one_line_per_finding(tmp_path):
    """`.pre-commit-hooks.yaml`'s entry, run as pre-commit runs it (the console script, the matching files appended):
    one line per finding, files of no launcher skipped, the exit status of the check."""
    import re
    import shlex
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parent.parent
    (hook,) = yaml.safe_load((root / ".pre-commit-hooks.yaml").read_text())
    assert hook["id"] == "trl-gc-check" and hook["language"] == "system"
    files = {
        "sft.yaml": "model_name_or_path: Qwen/Qwen2-0.5B\ndataset_name: trl-lib/Capybara\noutput_dir: out\n",
        "refused.yaml": "model_name_or_path: Qwen/Qwen2-0.5B\ndataset_name: trl-lib/Capybara\noutput_dir: out\n"
        "gradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: false}\nfsdp: full_shard\n"
        "fsdp_config: {activation_checkpointing: true}\n",
        ".github/workflows/ci.yml": "on: push\njobs: {}\n",
        "accelerate.yaml": "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n",
        "notes.txt": "not matched by the hook's pattern\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    matched = sorted(n for n in files if re.search(hook["files"], n))
    assert "notes.txt" not in matched and ".github/workflows/ci.yml" in matched
    words = shlex.split(hook["entry"])
    script = shutil.which(words[0], path=str(Path(sys.executable).parent))
    assert script is not None, "the console script is installed beside this Python"

    def run(names):
        proc = subprocess.run([script, *words[1:], *names], cwd=tmp_path, capture_output=True, text=True)
        return proc.returncode, proc.stdout.splitlines()

    code, lines = run(matched)
    assert code == 1, lines  # strict refuses refused.yaml
    assert "sft.yaml: ok" in lines
    assert any(line.startswith("refused.yaml: refused [fsdp-activation-checkpointing] error:") for line in lines)
    assert not any("ci.yml" in line or "accelerate.yaml" in line for line in lines)  # no training config: skipped
    assert run(["sft.yaml", ".github/workflows/ci.yml"]) == (0, ["sft.yaml: ok"])
