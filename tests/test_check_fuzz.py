"""No input makes the check raise: generated configs over every key the CLI reads (any type at any level), in the
format of each launcher, random bytes, and random option values. Every file ends as fine, refused or one clear
error line, and never as "internal error" (a bug of the check)."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_gc_plugin.cli.check import check_main
from trl_gc_plugin.configcheck.check import READ_KEYS, Launch, check_files
from trl_gc_plugin.configcheck.launchers import axolotl, llamafactory, trl

pytestmark = pytest.mark.line_independent

WORDS = ["true", "false", "yes", "no", "off", "on", "offload", "offload_disk", "unsloth", "legacy", "disk",
         "hidden_states", "lora", "qlora", "full", "freeze", "dpo", "ebft", "strided", "flex_attention", "sft",
         "zero3", "zero3.json", "deepspeed_configs/zero3.json", "examples/deepspeed/ds_z3_config.json", "fsdp2",
         "full_shard", "{\"use_reentrant\": false}", "{broken", "", "4", "auto", "gemma-4", "mpt-7b"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10), st.integers(), st.floats(), st.sampled_from(WORDS), st.text(max_size=12)
)
NESTED_KEYS = st.sampled_from(["use_reentrant", "stage", "zero_optimization", "activation_checkpointing", "fsdp_activation_checkpointing",
                               "fsdp_version", "mode", "save", "every_n_layers", "offload", "context_fn", "x"])
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NESTED_KEYS, inner, max_size=4),
    max_leaves=10,
)
MARKERS = {"trl": {"model_name_or_path": "m", "dataset_name": "d"}, "axolotl": {"base_model": "b", "sequence_len": 8},
           "llamafactory": {"model_name_or_path": "m", "stage": "sft", "template": "qwen"}, "none": {}}
KEYS = sorted(READ_KEYS | trl.MARKERS | axolotl.MARKERS | llamafactory.MARKERS)


def assert_no_bug(reports):
    for report in reports:
        assert report.status in ("ok", "refused", "error")
        if report.status == "error":
            assert report.error and "\n" not in report.error
            assert "internal error" not in report.error, report.error
        else:
            assert report.facts is not None and report.decisions


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(MARKERS)),
    body=st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=8),
    as_json=st.booleans(),
    nproc=st.sampled_from([None, 1, 2, 8]),
    trainer=st.sampled_from([None, "sft", "dpo", "grpo", "orpo"]),
    old_deepspeed=st.booleans(),
)
def test_generated_configs_never_raise(tmp_path, kind, body, as_json, nproc, trainer, old_deepspeed):
    document = {**MARKERS[kind], **body}
    path = tmp_path / ("gen.json" if as_json else "gen.yaml")
    try:
        path.write_text(json.dumps(document) if as_json else yaml.safe_dump(document, allow_unicode=True))
    except (ValueError, TypeError):  # NaN etc. in strict JSON: write what Python's json writes
        path.write_text(json.dumps(document, default=str))
    versions = (("deepspeed", "0.19.2"),) if old_deepspeed else ()
    assert_no_bug(check_files([str(path)], Launch(parser="model", nproc=nproc, trainer=trainer, versions=versions)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=300), suffix=st.sampled_from([".yaml", ".json", ".yml", ""]))
def test_random_bytes_never_raise(tmp_path, content, suffix):
    path = tmp_path / f"random{suffix}"
    path.write_bytes(content)
    assert_no_bug(check_files([str(path)], Launch(parser="model")))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    option=st.sampled_from(["--nproc", "--trainer", "--mode", "--format", "--parser", "--timeout", "--accelerate-config",
                            "--transformers-version", "--deepspeed-version", "--peft-version"]),
    value=st.one_of(st.sampled_from(["-3", "0", "1", "latest", "nan", "inf", "1e400", "5.23.0", "zero3", "", " "]), st.text(min_size=1, max_size=10)),
)
def test_random_option_values_never_raise(tmp_path, capsys, option, value):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: m\ndataset_name: d\n")
    if value.startswith("-"):
        value = " " + value  # argparse would read it as an option: that is a usage error, tested elsewhere
    try:
        code = check_main([str(config), option, value, "--parser", "model"])
    except SystemExit as exc:
        code = int(exc.code or 0)
    _, err = capsys.readouterr()
    assert code in (0, 1, 2)
    assert "Traceback" not in err and "internal error" not in err
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("error: ")


@pytest.mark.parametrize("kind", sorted(MARKERS))
def test_every_key_with_every_type(tmp_path, kind):
    """Each key the CLI reads, alone, with a value of each type: never an internal error."""
    samples = [None, True, 0, 7, -1, 1.5, "", "false", "x", [], [1], ["a"], {}, {"use_reentrant": "x"}, {"stage": [3]}]
    paths = []
    for i, key in enumerate(KEYS):
        for j, value in enumerate(samples):
            path = tmp_path / f"{i}_{j}.yaml"
            path.write_text(yaml.safe_dump({**MARKERS[kind], key: value}))
            paths.append(str(path))
    assert_no_bug(check_files(paths, Launch(parser="model", nproc=2)))
