"""One reading of a DeepSpeed config (`trl_gc_plugin.core.deepspeed_config`) for the running plugin and `trl-gc-check` (issue
19): each tricky config goes through both real paths (`probe` on arguments naming the JSON file, and the check's
`read.deepspeed.read_deepspeed` on the same file), which must agree, and the values are DeepSpeed's own where
DeepSpeed can tell (its config classes, when installed)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from trl_gc_plugin.configcheck.read.common import ConfigError
from trl_gc_plugin.configcheck.read.deepspeed import read_deepspeed
from trl_gc_plugin.core.deepspeed_config import ACTIVATION_CHECKPOINTING_KEYS, deepspeed_facts
from trl_gc_plugin.model import probe

pytestmark = pytest.mark.line_independent

# name: (config, (stage, activation_checkpointing, overlap_comm) or the start of the problem)
CASES: dict[str, tuple[dict[str, Any], tuple[int | None, bool, bool | None] | str]] = {
    "unknown-key-only": ({"zero_optimization": {"stage": 2}, "activation_checkpointing": {"checkpoint_in_cpu": True}},
                         (2, False, False)),
    "partition-string-false": ({"zero_optimization": {"stage": 2},
                                "activation_checkpointing": {"partition_activations": "false"}}, (2, True, False)),
    "partition-false": ({"zero_optimization": {"stage": 3},
                         "activation_checkpointing": {"partition_activations": False}}, (3, False, True)),
    "number-checkpoints-0": ({"zero_optimization": {"stage": 1},
                              "activation_checkpointing": {"number_checkpoints": 0}}, (1, False, False)),
    "number-checkpoints-4": ({"zero_optimization": {"stage": 1},
                              "activation_checkpointing": {"number_checkpoints": 4}}, (1, True, False)),
    "stage1-overlap-missing": ({"zero_optimization": {"stage": 1}}, (1, False, False)),
    "stage3-overlap-missing": ({"zero_optimization": {"stage": 3}}, (3, False, True)),
    "stage1-overlap-string-true": ({"zero_optimization": {"stage": 1, "overlap_comm": "true"}}, (1, False, True)),
    "stage1-overlap-1": ({"zero_optimization": {"stage": 1, "overlap_comm": 1}}, (1, False, True)),
    "stage1-overlap-auto": ({"zero_optimization": {"stage": 1, "overlap_comm": "auto"}}, (1, False, False)),
    "stage3-overlap-auto": ({"zero_optimization": {"stage": 3, "overlap_comm": "auto"}}, (3, False, True)),
    "stage3-overlap-null": ({"zero_optimization": {"stage": 3, "overlap_comm": None}}, (3, False, True)),
    "stage3-overlap-off": ({"zero_optimization": {"stage": 3, "overlap_comm": "off"}}, (3, False, False)),
    "stage-string-3": ({"zero_optimization": {"stage": "3"}}, (3, False, True)),
    "stage-float-2": ({"zero_optimization": {"stage": 2.0}}, (2, False, False)),
    "stage-auto": ({"zero_optimization": {"stage": "auto"}}, (2, False, False)),
    "no-zero-block": ({"train_batch_size": 8}, (0, False, False)),
    "zero-null": ({"zero_optimization": None}, "key 'zero_optimization': expected a mapping"),
    "zero-bool": ({"zero_optimization": True}, "key 'zero_optimization': expected a mapping"),
    "stage-5": ({"zero_optimization": {"stage": 5}}, "key 'zero_optimization.stage': must be 0, 1, 2 or 3, got 5"),
    "stage-bool": ({"zero_optimization": {"stage": True}}, "key 'zero_optimization.stage': must be 0, 1, 2 or 3"),
    "stage-null": ({"zero_optimization": {"stage": None}}, "key 'zero_optimization.stage': must be 0, 1, 2 or 3"),
    "overlap-2": ({"zero_optimization": {"stage": 1, "overlap_comm": 2}},
                  "key 'zero_optimization.overlap_comm': expected true or false, got a number 2"),
    "overlap-padded": ({"zero_optimization": {"stage": 1, "overlap_comm": " true"}},
                       "key 'zero_optimization.overlap_comm': expected true or false"),
    "ac-null": ({"zero_optimization": {"stage": 3}, "activation_checkpointing": None},
                "key 'activation_checkpointing': expected a mapping, got null"),
    "ac-list": ({"zero_optimization": {"stage": 3}, "activation_checkpointing": []},
                "key 'activation_checkpointing': expected a mapping, got a list"),
}


@pytest.fixture(autouse=True)
def no_accelerate_env(monkeypatch):
    for name in ("ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    probe._LOGGED_PROBLEMS.clear()  # the runtime logs each problem once per process
    yield
    probe._LOGGED_PROBLEMS.clear()


def write(tmp_path, config: dict[str, Any]) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def runtime(args: Any) -> tuple[int | None, bool, bool | None]:
    facts = probe.facts_from_args(args)
    return facts.zero_stage, facts.deepspeed_activation_checkpointing, facts.zero_overlap_comm


@pytest.mark.parametrize("name", CASES)
def test_runtime_and_check_read_a_config_alike(name, tmp_path, caplog):
    config, expected = CASES[name]
    path = write(tmp_path, config)
    args = SimpleNamespace(deepspeed=path, gradient_checkpointing=True, gradient_checkpointing_kwargs=None)
    facts = deepspeed_facts(config)
    with caplog.at_level(logging.WARNING, logger="trl_gc_plugin"):
        seen = runtime(args)
    if isinstance(expected, str):  # a problem: the check refuses the file with it; the runtime logs it, reads on
        assert facts.problems and facts.problems[0].startswith(expected)
        with pytest.raises(ConfigError, match="DeepSpeed config") as err:
            read_deepspeed(path, "train.yaml", "deepspeed", str(tmp_path), {}, "")
        assert facts.problems[0] in str(err.value)
        assert seen == (facts.stage, facts.activation_checkpointing, facts.overlap_comm)
        assert f"DeepSpeed config: {facts.problems[0]}" in caplog.text
        return
    assert not facts.problems
    read = read_deepspeed(path, "train.yaml", "deepspeed", str(tmp_path), {}, "")
    assert (read.stage, read.activation_checkpointing, read.overlap_comm) == expected
    assert seen == expected
    inline = read_deepspeed(config, "train.yaml", "deepspeed", str(tmp_path), {}, "")
    assert (inline.stage, inline.activation_checkpointing, inline.overlap_comm) == expected


def test_the_runtime_logs_a_problem_once(tmp_path, caplog):
    args = SimpleNamespace(deepspeed=write(tmp_path, {"zero_optimization": {"stage": 3, "overlap_comm": "maybe"}}))
    with caplog.at_level(logging.WARNING, logger="trl_gc_plugin"):
        assert probe.zero_stage(args) == 3
        probe.facts_from_args(args)
    assert [r.getMessage() for r in caplog.records] == [
        "DeepSpeed config: key 'zero_optimization.overlap_comm': expected true or false, got a string 'maybe'"
    ]


def test_stage_auto_follows_accelerates_stage(tmp_path, monkeypatch):
    args = SimpleNamespace(deepspeed=write(tmp_path, {"zero_optimization": {"stage": "auto"}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert (probe.zero_stage(args), probe.facts_from_args(args).zero_overlap_comm) == (3, True)
    read = read_deepspeed(args.deepspeed, "train.yaml", "deepspeed", str(tmp_path), {}, "")
    assert read.stage == 2 and "'auto': read as 2" in read.note  # the check reads the launch's default


# What DeepSpeed and accelerate themselves make of the same configs.


def _deepspeed_reading(config: dict[str, Any]) -> tuple[int | None, bool, bool | None] | None:
    """DeepSpeed 0.19's classes on the config after accelerate filled a stage `auto` (2); None when one raises."""
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig
    from deepspeed.runtime.zero.config import get_zero_config

    config = json.loads(json.dumps(config))
    zero = config.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") == "auto":
        zero["stage"] = 2
    try:
        if isinstance(zero, bool):  # DeepSpeed reads the old form; accelerate's DeepSpeedPlugin raises first
            raise TypeError("accelerate: 'bool' object has no attribute 'get'")
        zc = get_zero_config(config)
        ac = DeepSpeedActivationCheckpointingConfig(config)
    except Exception:
        return None
    asks = any(bool(getattr(ac, key)) for key in ACTIVATION_CHECKPOINTING_KEYS)
    return int(zc.stage), asks, zc.overlap_comm


@pytest.mark.parametrize("name", CASES)
def test_the_facts_are_deepspeeds(name):
    pytest.importorskip("deepspeed")
    config, expected = CASES[name]
    theirs = _deepspeed_reading(config)
    if name == "stage-bool":  # the one deliberate difference: pydantic takes a JSON true as stage 1
        assert theirs == (1, False, False) and isinstance(expected, str)
    elif isinstance(expected, str):
        assert theirs is None
    else:
        assert theirs == expected


@pytest.mark.parametrize("value", [True, False, 0, 1, 0.0, 1.0, 2, "true", "TRUE", "Yes", "on", "t", "y", "1", "0",
                                   "false", "Off", "no", "n", "f", " true", "maybe", "", None, "auto", [], {}])
@pytest.mark.parametrize("stage", [1, 3])
def test_overlap_comm_as_deepspeed_validates_it(value, stage):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ours = deepspeed_facts({"zero_optimization": {"stage": stage, "overlap_comm": value}})
    try:
        theirs = DeepSpeedZeroConfig(stage=stage, overlap_comm=value).overlap_comm
    except Exception:
        theirs = None
    assert ours.overlap_comm == theirs and bool(ours.problems) == (theirs is None)


@pytest.mark.parametrize("value", [0, 1, 2, 3, 4, -1, 2.0, 2.5, "2", " 3", "3.0", "x", "", None, "nan", [], 10**400])
def test_stage_as_deepspeed_validates_it(value):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ours = deepspeed_facts({"zero_optimization": {"stage": value}})
    try:
        theirs: int | None = int(DeepSpeedZeroConfig(stage=value).stage)
    except Exception:
        theirs = None
    assert ours.stage == theirs and bool(ours.problems) == (theirs is None)


AGREEING = [name for name, (_, expected) in CASES.items() if not isinstance(expected, str)]


@pytest.mark.parametrize("name", AGREEING)
def test_real_training_arguments(name, tmp_path, monkeypatch):
    """The same through transformers' `TrainingArguments` (its accelerate `DeepSpeedPlugin` fills a stage `auto`)."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from trainers import common_args
    from transformers import TrainingArguments

    config, expected = CASES[name]
    if "zero_optimization" not in config:
        pytest.skip("accelerate's DeepSpeedPlugin refuses a config without zero_optimization")
    batch = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    path = write(tmp_path, {**config, **batch})
    args = TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True, deepspeed=path, use_cpu=False))
    assert runtime(args) == expected


@pytest.mark.parametrize(("zero", "window"), [
    ({"stage": 3}, 1_050_000_000),  # DeepSpeed's defaults: reuse distance 1e9, prefetch bucket 5e7
    ({"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1000}, 1000),
    ({"stage": 3, "stage3_max_reuse_distance": 1e8, "stage3_prefetch_bucket_size": "auto"}, 150_000_000),
    ({"stage": 3, "stage3_max_reuse_distance": -1, "stage3_prefetch_bucket_size": True}, 1_050_000_000),
])
def test_the_zero3_gather_window_is_the_reuse_distance_and_prefetch_bucket(zero, window):
    assert deepspeed_facts({"zero_optimization": zero}).gather_window == window
