"""Read an accelerate config (`accelerate launch --config_file`): a model of accelerate 1.15's
`_validate_launch_command` and `prepare_*_env` (read, not imported; `EVIDENCE`), and TRL's bundled configs
(`accelerate_config: zero3`), found in the installed TRL without importing it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from ..._base.flags import pydantic_bool
from ...core.context_parallel import KEY as CP_KEY
from ...core.context_parallel import cp_size_of
from .common import ConfigError, expect_mapping, short, type_name
from .deepspeed import read_deepspeed
from .load import load_yaml_file

EVIDENCE = (
    "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/commands/launch.py "
    "(_validate_launch_command: config values fill unset launch arguments)",
    "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/utils/launch.py (prepare_multi_gpu_env: "
    "ACCELERATE_DEEPSPEED_ZERO_STAGE, FSDP_ACTIVATION_CHECKPOINTING, FSDP_VERSION)",
    "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/utils/dataclasses.py (DeepSpeedPlugin: "
    "zero_stage defaults to 2)",
    "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/utils/dataclasses.py "
    "(FullyShardedDataParallelPlugin.__post_init__: FSDP1 sharding_strategy from FSDP_SHARDING_STRATEGY, FSDP2 "
    "reshard_after_forward from FSDP_RESHARD_AFTER_FORWARD)",
    "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/accelerator.py (FSDP1: sharding_strategy "
    "or reshard_after_forward)",
)

FSDP_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
"""accelerate's `FSDP_SHARDING_STRATEGY` (`utils/constants.py`): names, or 1-5 in this order."""

DISTRIBUTED_TYPES = frozenset(
    {
        "NO",
        "MULTI_GPU",
        "MULTI_CPU",
        "MULTI_NPU",
        "MULTI_XPU",
        "MULTI_MLU",
        "MULTI_SDAA",
        "MULTI_MUSA",
        "MULTI_HPU",
        "MULTI_NEURON",
        "DEEPSPEED",
        "FSDP",
        "XLA",
        "MEGATRON_LM",
        "TP",
    }
)


@dataclass(frozen=True)
class AccelerateConfig:
    """The launch facts of an accelerate config (None, or 1: the file does not say). `fsdp_sharding` is an FSDP1
    strategy name (FSDP2's `reshard_after_forward` true is `FULL_SHARD`, false `SHARD_GRAD_OP`)."""

    path: str
    distributed_type: str
    num_processes: int | None
    zero_stage: int | None
    deepspeed_activation_checkpointing: bool
    fsdp: bool
    fsdp_version: int | None
    fsdp_activation_checkpointing: bool
    cp_size: int = 1
    dynamo_backend: str | None = None
    fsdp_sharding: str | None = None
    num_machines: int = 1
    fp8: bool = False
    """`mixed_precision: fp8` (rule `fp8-checkpointing`)."""


def _trl_config_dirs() -> list[str]:
    try:
        spec = importlib.util.find_spec("trl")
    except (ImportError, ValueError):
        return []
    folders = (spec.submodule_search_locations or []) if spec else []
    return [d for d in (os.path.join(f, "accelerate_configs") for f in folders) if os.path.isdir(d)]


def trl_bundled(name: str) -> str | None:
    """The path of the installed TRL's bundled accelerate config `name` (`zero3`, `fsdp2`, ...), or None."""
    files = (os.path.join(d, f"{name}.yaml") for d in _trl_config_dirs())
    return next((f for f in files if os.path.isfile(f)), None)


def trl_bundled_names() -> list[str]:
    return [n for d in _trl_config_dirs() for n in sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))]


def whole_number(value: Any, label: str, key: str, minimum: int) -> int:
    """`value` as an int >= `minimum` (accelerate reads these keys as ints)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{label}: key {key!r}: expected a whole number, got {type_name(value)} {short(value)}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{label}: key {key!r}: expected a whole number, got {short(value)}") from None
    if number < minimum:
        raise ConfigError(f"{label}: key {key!r}: must be >= {minimum}, got {number}")
    return number


def read_accelerate(file: str, overrides: dict[str, Any] | None = None) -> AccelerateConfig:
    """Read the accelerate config at `file`; `overrides` are launch arguments given beside it, which win (TRL passes
    the YAML's top-level `num_processes`, `zero_stage`, ... to `accelerate launch`)."""
    label = f"accelerate config {file}"
    data = load_yaml_file(file, "accelerate config")
    data = expect_mapping({} if data is None else data, label, "(top level)")
    overrides = overrides or {}
    kind = data.get("distributed_type", "NO")
    if not isinstance(kind, str) or kind.upper() not in DISTRIBUTED_TYPES:
        raise ConfigError(
            f"{label}: key 'distributed_type': not one of accelerate's types ({', '.join(sorted(DISTRIBUTED_TYPES))}): "
            f"{short(kind)}"
        )
    kind = kind.upper()
    procs = overrides.get("num_processes", data.get("num_processes"))
    num_processes = None if procs is None else whole_number(procs, label, "num_processes", 1)

    zero_stage: int | None = None
    ds_ac = False
    if kind == "DEEPSPEED":
        ds = expect_mapping(data.get("deepspeed_config") or {}, label, "deepspeed_config")
        stage = overrides.get("zero_stage", ds.get("zero_stage"))
        ds_file = overrides.get("deepspeed_config_file", ds.get("deepspeed_config_file"))
        if ds_file not in (None, "", "none"):
            read = read_deepspeed(ds_file, label, "deepspeed_config_file", os.path.dirname(file), {}, "")
            zero_stage, ds_ac = read.stage, read.activation_checkpointing
        elif stage is not None:
            zero_stage = whole_number(stage, label, "zero_stage", 0)
            if zero_stage > 3:
                raise ConfigError(f"{label}: key 'zero_stage': must be 0, 1, 2 or 3, got {zero_stage}")
        else:
            zero_stage = 2

    fsdp = kind == "FSDP"
    fsdp_version: int | None = None
    fsdp_ac = False
    sharding: str | None = None
    if fsdp:
        fc = expect_mapping(data.get("fsdp_config") or {}, label, "fsdp_config")
        fc = {(k if str(k).startswith("fsdp") else f"fsdp_{k}"): v for k, v in fc.items()}
        fsdp_version = whole_number(overrides.get("fsdp_version", fc.get("fsdp_version", 1)), label, "fsdp_version", 1)
        raw = overrides.get("fsdp_activation_checkpointing", fc.get("fsdp_activation_checkpointing", False))
        parsed = pydantic_bool(raw.lower() if isinstance(raw, str) else raw)
        if parsed is None:
            raise ConfigError(f"{label}: key 'fsdp_activation_checkpointing': expected true or false, got {short(raw)}")
        fsdp_ac = parsed
        sharding = _fsdp_sharding(fc, fsdp_version, label)
    machines_raw = data.get("num_machines")
    machines = 1 if machines_raw is None else whole_number(machines_raw, label, "num_machines", 1)
    parallel = expect_mapping(data.get("parallelism_config") or {}, label, "parallelism_config")
    cp_size = cp_size_of(parallel)
    if cp_size is None:
        raise ConfigError(f"{label}: key 'parallelism_config.{CP_KEY}': expected a whole number >= 1")
    dynamo = expect_mapping(data.get("dynamo_config") or {}, label, "dynamo_config")
    backend = dynamo.get("dynamo_backend")
    return AccelerateConfig(
        path=file,
        distributed_type=kind,
        num_processes=num_processes,
        zero_stage=zero_stage,
        deepspeed_activation_checkpointing=ds_ac,
        fsdp=fsdp,
        fsdp_version=fsdp_version,
        fsdp_activation_checkpointing=fsdp_ac,
        cp_size=cp_size,
        dynamo_backend=None if backend in (None, False) or str(backend).lower() == "no" else str(backend),
        fsdp_sharding=sharding,
        num_machines=machines,
        fp8=str(overrides.get("mixed_precision", data.get("mixed_precision", ""))).lower() == "fp8",
    )


def _fsdp_sharding(fc: dict[str, Any], version: int, label: str) -> str:
    """How FSDP shards under `accelerate launch` with this `fsdp_config` (keys already `fsdp_`-prefixed)."""
    if version == 2:
        raw = fc.get("fsdp_reshard_after_forward", True)
        reshard = pydantic_bool(str(raw).lower())  # accelerate's str_to_bool takes the same words
        if reshard is None:
            raise ConfigError(f"{label}: key 'fsdp_reshard_after_forward': FSDP2 takes true or false, got {short(raw)}")
        return "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
    raw = fc.get("fsdp_sharding_strategy", "FULL_SHARD")
    text = str(raw).strip().upper()
    if text in FSDP_SHARDING_STRATEGIES:
        return text
    if text.isdigit() and 1 <= int(text) <= len(FSDP_SHARDING_STRATEGIES):
        return FSDP_SHARDING_STRATEGIES[int(text) - 1]
    raise ConfigError(
        f"{label}: key 'fsdp_sharding_strategy': not one of {', '.join(FSDP_SHARDING_STRATEGIES)} (or 1-5): "
        f"{short(raw)}"
    )


def set_accelerate_facts(reading: Any, accel: AccelerateConfig | None, where_accel: str) -> None:
    """The context-parallel size and compile backend (the run reads both from what `accelerate launch` exports)."""
    if accel is None:
        return
    if accel.cp_size > 1:
        reading.set("cp_size", accel.cp_size, "accelerate config", f"{where_accel}: parallelism_config.{CP_KEY}")
    if accel.fp8:
        reading.set("fp8", "accelerate mixed_precision: fp8", "accelerate config", f"{where_accel}: mixed_precision")
    if accel.dynamo_backend is not None:
        reading.set(
            "compiled",
            f"ACCELERATE_DYNAMO_BACKEND={accel.dynamo_backend}",
            "accelerate config",
            f"{where_accel}: dynamo_config.dynamo_backend",
        )
