"""`trl-gc-plan` (`trl_gc_plugin.cli.plan.main`) on real config files (tests/data/plan_*) and named layouts; malformed
input exits 2 with one line on stderr and never a traceback, including for generated input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_gc_plugin.cli import plan as plan_cli

DATA = Path(__file__).with_name("data")
TINY = str(DATA / "plan_tiny.json")


def run(capsys, *argv):
    code = plan_cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("source", [TINY, str(DATA / "plan_llama_tiny")])
def test_a_config_file_or_its_directory_gets_a_plan(capsys, source):
    code, out, err = run(capsys, source, "--batch-size", "2", "--seq-len", "32", "--budget", "10MiB")
    assert code == 0 and err == ""
    assert "plan: none" in out  # 10 MiB is more than the tiny model needs without checkpointing
    assert "candidate" in out and "full" in out and "selective" in out


def test_json_output_is_the_plan(capsys):
    code, out, _ = run(capsys, TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "1MiB", "--json", "--all")
    data = json.loads(out)
    assert code == (0 if data["fits"] else 1)
    chosen = next(c for c in data["candidates"] if c["name"] == data["chosen"])
    assert chosen["peak_bytes"] <= data["budget_bytes"] == 2**20
    cheaper = [c for c in data["candidates"] if c["allowed"] and c["recompute"] < chosen["recompute"]]
    assert all(c["peak_bytes"] > 2**20 for c in cheaper)
    names = [c["name"] for c in data["candidates"]]
    # none, 1..3 of 4, full, selective, selective-lean (the MLP widens), offload, and the per-block plan for this
    # budget when it is none of them
    assert len([n for n in names if n != "mixed"]) == 4 + 4 and names.count("mixed") <= 1
    assert "selective-lean" in names


def test_nothing_fits_exits_1_with_the_lowest_memory_plan(capsys):
    code, out, err = run(capsys, TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "1KiB")
    assert code == 1 and err == ""
    assert "nothing fits" in out and "lowest-memory plan" in out


def test_reentrant_and_accelerator_change_what_is_allowed(capsys):
    args = (TINY, "--batch-size", "2", "--seq-len", "32", "--budget", "1MiB", "--json")
    plain = json.loads(run(capsys, *args)[1])
    other = json.loads(run(capsys, *args, "--reentrant", "--accelerator")[1])

    def allowed(data, name):
        return next(c["allowed"] for c in data["candidates"] if c["name"] == name)

    assert allowed(plain, "selective") and not allowed(plain, "offload")
    assert not allowed(other, "selective") and allowed(other, "offload")


def test_the_7b_layout_plan(capsys):
    code, out, _ = run(capsys, "llama-7b", "--batch-size", "1", "--seq-len", "4096", "--budget", "16GiB", "--json")
    data = json.loads(out)
    assert code == 0 and data["estimate"]["blocks"] == 32 and data["estimate"]["dtype"] == "bfloat16"
    none = next(c for c in data["candidates"] if c["name"] == "none")
    assert none["saved_bytes"] > 16 * 2**30  # 23.4 GiB: no checkpointing does not fit
    chosen = next(c for c in data["candidates"] if c["name"] == data["chosen"])
    assert chosen["peak_bytes"] <= 16 * 2**30 and chosen["name"] != "full"


def test_gradient_shards_lower_the_70b_peak(capsys):
    args = ("llama3-70b", "--batch-size", "1", "--seq-len", "2048", "--budget", "40GiB")
    assert run(capsys, *args)[0] == 1  # 131 GiB of bf16 gradients on one device
    assert run(capsys, *args, "--grad-shards", "8")[0] == 0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("plan_malformed.json", "line 3, column 21"),
        ("plan_list.json", "must be a JSON object"),
        ("plan_no_model_type.json", "key 'model_type'"),
        ("plan_bad_hidden.json", "key 'hidden_size': expected a positive integer"),
        ("plan_unknown_type.json", "unknown model type 'no-such-model'"),
        ("plan_not_causal.json", "'vit' has no causal language model"),
        ("plan_heads_do_not_divide.json", "is not a multiple of 5"),
        ("plan_not_text.json", "not a UTF-8 text file"),
        ("does_not_exist.json", "no such file, directory or layout"),
    ],
)
def test_unreadable_configs_exit_2_with_one_line(capsys, name, message):
    code, out, err = run(capsys, str(DATA / name), "--batch-size", "1", "--seq-len", "8", "--budget", "1GiB")
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and err.startswith("trl-gc-plan: error: ")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--batch-size", "x", "--seq-len", "8", "--budget", "1GiB"], "--batch-size"),
        (["--batch-size", "0", "--seq-len", "8", "--budget", "1GiB"], "positive"),
        (["--batch-size", "1", "--seq-len", "8"], "--budget"),
        (["--batch-size", "1", "--seq-len", "8", "--budget=-2GiB"], "memory budget"),
        (["--batch-size", "1", "--seq-len", "8", "--budget", "lots"], "40GiB"),
        (["--batch-size", "1", "--seq-len", "8", "--budget", "1GiB", "--dtype", "int8"], "--dtype"),
        (["--batch-size", "1", "--seq-len", "8", "--budget", "1GiB", "--attn", "flash"], "--attn"),
        (["--batch-size", "1", "--seq-len", "8", "--budget", "1GiB", "--grad-shards", "0"], "--grad-shards"),
        (["--batch-size", "100000", "--seq-len", "100000", "--budget", "1GiB"], "at most"),
        (["--batch-size", "1", "--seq-len", "8", "--budget", "1GiB", "--bogus"], "unrecognized"),
    ],
)
def test_invalid_options_exit_2_with_one_line(capsys, options, message):
    code, out, err = run(capsys, TINY, *options)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--budget" in out and "llama3-8b" in out


def test_the_module_runs_as_a_command():
    """Through a real interpreter: the exit status and stderr a shell sees."""
    proc = subprocess.run(
        [sys.executable, "-m", "trl_gc_plugin.cli.plan", str(DATA / "plan_malformed.json"), "--batch-size", "1",
         "--seq-len", "8", "--budget", "1GiB"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "tie_word_embeddings", "torch_dtype", "layer_types", "head_dim")
VALUES = st.one_of(
    st.integers(min_value=-4, max_value=64),
    st.sampled_from(["llama", "qwen2", "mistral", "gpt2", "vit", "", "float32", "bfloat16", "int8"]),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    st.lists(st.sampled_from(["full_attention", "sliding_attention", 3]), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _check_outcome(code: int, out: str, err: str) -> None:
    assert code in (0, 1, 2)
    assert "Traceback" not in err and "Traceback" not in out
    if code == 2:
        assert out == "" and err.count("\n") == 1 and err.startswith("trl-gc-plan: error: ")
    else:
        assert err == "" and ("plan:" in out or "nothing fits" in out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    config=st.one_of(
        st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=len(KEYS)),
        st.lists(st.integers(), max_size=3),
        st.text(max_size=30),
    )
)
def test_generated_configs_never_crash(capsys, config):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(config if isinstance(config, str) else json.dumps(config))
        code = plan_cli.main([path, "--batch-size", "1", "--seq-len", "8", "--budget", "1MiB"])
    _check_outcome(code, *capsys.readouterr())


TOKENS = [TINY, "llama-7b-typo", "--batch-size", "--seq-len", "--budget", "--dtype", "--attn", "--grad-shards",
          "--sharded-params", "zero3", "fsdp2", "--deepspeed", "--accelerate-config",
          "--json", "--all", "--reentrant", "--accelerator", "1", "2", "0", "-1", "x", "1MiB", "2GB", "nan", "bf16",
          "fp8", "sdpa", "eager", ""]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.lists(st.sampled_from(TOKENS), max_size=10))
def test_generated_command_lines_never_crash(capsys, argv):
    code = plan_cli.main(argv)
    out, err = capsys.readouterr()
    if code == 0 and "usage:" in out:  # --help among the tokens is not generated, but be exact anyway
        return
    if "--json" in argv and code in (0, 1):
        json.loads(out)
        assert err == ""
        return
    _check_outcome(code, out, err)


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_params_count_what_the_run_counts(capsys, tmp_path, tied):
    """`--sharded-params` adds the parameters held whole as the run does on the live model (`runtime_plan`, whose
    terms tests/test_zero12.py and tests/test_fsdp.py measure on 2 CPU ranks with this model): ZeRO-3 keeps the whole
    of a model under its 1e9-element reuse distance; FSDP1 its root unit (everything outside the blocks) and two
    blocks; FSDP2 two blocks or the head and the last block, and with tied embeddings accelerate's group of the
    embeddings, the final norm and the head besides two blocks."""
    from trl_gc_plugin.testing import make_config, make_model

    make_config(tie_word_embeddings=tied).to_json_file(tmp_path / "config.json")
    model = make_model(tie_word_embeddings=tied)

    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    block, total = size(model.model.layers[0]), size(model)
    head, norm, embed = size(model.lm_head), size(model.model.norm), size(model.model.embed_tokens)
    expected = {
        None: 0,
        "zero3": total,
        "fsdp1": (total - 2 * block) + 2 * block,  # the root unit (all but the two blocks), two blocks
        "fsdp2": embed + norm + 2 * block if tied else max(2 * block, head + block),
        "fsdp1-shard-grad-op": total,  # every unit whole from its forward to its backward (measured: test_fsdp.py)
        "fsdp2-no-reshard": total,
    }
    for layout, gathered in expected.items():
        extra = [] if layout is None else ["--sharded-params", layout]
        code, out, err = run(capsys, str(tmp_path), "--batch-size", "2", "--seq-len", "16", "--budget", "1GiB",
                             "--dtype", "fp32", "--grad-shards", "2", "--json", *extra)
        assert code == 0 and err == "", err
        assert json.loads(out)["estimate"]["gathered_bytes"] == gathered, layout


def test_a_deepspeed_config_plans_what_the_run_reads(capsys, tmp_path):
    """`--deepspeed CONFIG` reads the run's config through the one DeepSpeed reader: ZeRO-3 shards the parameters, and
    its reuse distance and prefetch bucket bound what stays gathered (a window of 0 leaves the two blocks the run
    counts anyway); ZeRO-2 does not shard them; a disagreeing `--sharded-params` or an unreadable config exits 2."""
    def gathered(zero: dict | None, *extra: str) -> tuple[int, int | None, str]:
        argv = [TINY, "--batch-size", "2", "--seq-len", "16", "--budget", "1GiB", "--json", *extra]
        if zero is not None:
            (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": zero}))
            argv += ["--deepspeed", str(tmp_path / "ds.json")]
        code, out, err = run(capsys, *argv)
        return code, json.loads(out)["estimate"]["gathered_bytes"] if code == 0 else None, err

    assert gathered({"stage": 3})[1] == gathered(None, "--sharded-params", "zero3")[1] > 0
    small = gathered({"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0})[1]
    assert 0 < small < gathered({"stage": 3})[1]
    assert gathered({"stage": 2})[1] == 0
    code, _, err = gathered({"stage": 2}, "--sharded-params", "zero3")
    assert code == 2 and "disagrees" in err
    code, _, err = gathered({"stage": "x"})
    assert code == 2 and "zero_optimization.stage" in err


ACCELERATE_CASES = [
    # (accelerate config, the layout and gradient shards `accelerate launch` gives it)
    ({"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2}}, "fsdp2", 2),
    ({"distributed_type": "FSDP", "num_processes": 2,
      "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False}}, "fsdp2-no-reshard", 2),
    ({"distributed_type": "FSDP", "num_processes": 4, "fsdp_config": {}}, "fsdp1", 4),  # FULL_SHARD by default
    ({"distributed_type": "FSDP", "num_processes": 4,
      "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}}, "fsdp1-shard-grad-op", 4),
    # accelerate prefixes fsdp_config keys with fsdp_, and takes a strategy's number (2: SHARD_GRAD_OP)
    ({"distributed_type": "FSDP", "num_processes": 4, "fsdp_config": {"sharding_strategy": 2}}, "fsdp1-shard-grad-op", 4),
    ({"distributed_type": "FSDP", "num_processes": 8, "num_machines": 2,
      "fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD"}}, "fsdp1", 4),  # sharded within a machine
    ({"distributed_type": "FSDP", "num_processes": 4, "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD"}}, None, 1),
    ({"distributed_type": "DEEPSPEED", "num_processes": 4, "deepspeed_config": {"zero_stage": 3}}, "zero3", 4),
    ({"distributed_type": "DEEPSPEED", "num_processes": 4, "deepspeed_config": {}}, None, 4),  # ZeRO-2 by default
    ({"distributed_type": "DEEPSPEED", "num_processes": 4, "deepspeed_config": {"zero_stage": 1}}, None, 1),
    ({"distributed_type": "MULTI_GPU", "num_processes": 4}, None, 1),
]


@pytest.mark.parametrize(("accel", "layout", "shards"), ACCELERATE_CASES)
def test_an_accelerate_config_plans_the_sharding_it_launches(capsys, tmp_path, accel, layout, shards):
    """`--accelerate-config FILE` reads the sharding and the gradient shards of an `accelerate launch` config through
    the reader `trl-gc-check` uses (accelerate 1.15's launcher and FSDP plugin, read): the plan equals the one made
    with the options it stands for."""
    import yaml

    from trl_gc_plugin.testing import make_config

    make_config().to_json_file(tmp_path / "config.json")
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(accel))
    argv = [str(tmp_path), "--batch-size", "2", "--seq-len", "16", "--budget", "1GiB", "--dtype", "fp32", "--json"]
    code, out, err = run(capsys, *argv, "--accelerate-config", str(tmp_path / "accelerate.yaml"))
    assert code == 0 and err == "", err
    explicit = ["--grad-shards", str(shards), *([] if layout is None else ["--sharded-params", layout])]
    code, expected, err = run(capsys, *argv, *explicit)
    assert code == 0 and err == "", err
    assert json.loads(out) == json.loads(expected)


def test_an_accelerate_config_that_disagrees_or_is_malformed_exits_2(capsys, tmp_path):
    base = [TINY, "--batch-size", "2", "--seq-len", "16", "--budget", "1GiB"]
    fsdp2 = str(DATA / "accelerate_fsdp2.yaml")  # FSDP2, 2 processes
    code, _, err = run(capsys, *base, "--accelerate-config", fsdp2, "--sharded-params", "fsdp1")
    assert code == 2 and "disagrees" in err and "FSDP2 FULL_SHARD" in err
    code, _, err = run(capsys, *base, "--accelerate-config", fsdp2, "--grad-shards", "4")
    assert code == 2 and "--grad-shards 4 disagrees" in err and "over 2 devices" in err
    code, _, _ = run(capsys, *base, "--accelerate-config", fsdp2, "--grad-shards", "2", "--sharded-params", "fsdp2")
    assert code == 0
    (tmp_path / "a.yaml").write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    code, _, err = run(capsys, *base, "--accelerate-config", str(tmp_path / "a.yaml"))
    assert code == 2 and "give --grad-shards" in err
    assert run(capsys, *base, "--accelerate-config", str(tmp_path / "a.yaml"), "--grad-shards", "8")[0] == 0
    for bad in ("fsdp_sharding_strategy: HALF_SHARD", "fsdp_sharding_strategy: 6"):
        (tmp_path / "b.yaml").write_text(f"distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  {bad}\n")
        code, _, err = run(capsys, *base, "--accelerate-config", str(tmp_path / "b.yaml"))
        assert code == 2 and "fsdp_sharding_strategy" in err and "\n" not in err.strip(), err
    (tmp_path / "c.yaml").write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
                                     "  fsdp_reshard_after_forward: SHARD_GRAD_OP\n")
    code, _, err = run(capsys, *base, "--accelerate-config", str(tmp_path / "c.yaml"))
    assert code == 2 and "FSDP2 takes true or false" in err
    code, _, err = run(capsys, *base, "--accelerate-config", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err


def test_plot_writes_an_image_of_the_candidates(tmp_path, capsys):
    """`--plot FILE` (issue 39): the candidates' predicted peak against recompute, the budget line, the pick; a PNG
    that opens, of a plot's size, whose pixels are not blank; a path that cannot be written is exit 2."""
    image = pytest.importorskip("matplotlib.image")
    out = tmp_path / "plan.png"
    args = ["llama-7b", "--batch-size", "1", "--seq-len", "4096", "--budget", "20GiB"]
    assert plan_cli.main([*args, "--plot", str(out)]) == 0
    assert f"plot: {out}" in capsys.readouterr().out
    pixels = image.imread(str(out))
    assert pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert float(pixels[..., :3].std()) > 0.05  # points, lines and text, not an empty canvas
    assert plan_cli.main([*args, "--plot", str(tmp_path / "missing" / "plan.png")]) == 2
    assert "--plot" in capsys.readouterr().err
