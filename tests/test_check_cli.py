"""`python -m trl_gc_plugin check` / `trl-gc-check` on real config files (tests/data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).with_name("data")


def check(name, *options):
    proc = subprocess.run([sys.executable, "-m", "trl_gc_plugin", "check", str(DATA / name), *options],
                          capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


def test_a_plain_trl_lora_config_is_fine():
    code, out, _ = check("trl_sft_lora.yaml", "--transformers-version", "4.57.6")
    assert code == 0
    assert "non-reentrant-default" in out and "None -> False" in out


@pytest.mark.parametrize(("nproc", "code"), [("1", 0), ("2", 1)])
def test_explicit_reentrant_with_lora_under_ddp(nproc, code):
    rc, out, _ = check("trl_sft_lora_reentrant.yaml", "--nproc", nproc)
    assert rc == code
    assert ("ddp-reentrant-find-unused" in out) is (code == 1)


def test_string_false_is_repaired_not_refused():
    code, out, _ = check("trl_string_false.json")
    assert code == 0 and "invalid-use-reentrant" in out and "'false' -> False" in out


def test_fsdp_with_both_checkpointings():
    code, out, _ = check("trl_fsdp_both.yaml", "--nproc", "2")
    assert code == 1 and "fsdp-activation-checkpointing" in out


@pytest.mark.parametrize(("deepspeed", "code"), [("0.19.2", 1), ("0.19.8", 0)])
def test_axolotl_qlora_zero3_depends_on_the_deepspeed_release(deepspeed, code):
    rc, out, _ = check("axolotl_qlora_zero3.yml", "--nproc", "2", "--deepspeed-version", deepspeed)
    assert rc == code, out
    assert "ZeRO 3" in out
    assert ("zero3-frozen-needs-reentrant" in out) is (code == 1)


@pytest.mark.parametrize(("transformers", "code"), [("4.57.6", 1), ("5.23.0", 0)])
def test_axolotl_partially_frozen_with_reentrant(transformers, code):
    rc, out, _ = check("axolotl_unfrozen_reentrant.yml", "--transformers-version", transformers)
    assert rc == code, out
    assert ("frozen-inputs-need-non-reentrant" in out) is (code == 1)


def test_axolotl_multi_gpu_rl_qlora_reentrant():
    assert check("axolotl_rl_qlora.yml", "--nproc", "1")[0] == 0
    code, out, _ = check("axolotl_rl_qlora.yml", "--nproc", "2")
    assert code == 1 and "distributed-rl-qlora-no-reentrant" in out


@pytest.mark.parametrize(("name", "message"), [
    ("malformed.yaml", "line 3"),
    ("bad_kwargs.yaml", "key 'gradient_checkpointing_kwargs'"),
    ("does_not_exist.yaml", "cannot read"),
])
def test_unreadable_configs_exit_2_and_say_where(name, message):
    code, out, err = check(name)
    assert code == 2 and message in err and out == ""


def test_console_script_is_declared():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'trl-gc-check = "trl_gc_plugin.__main__:check_main"' in text
