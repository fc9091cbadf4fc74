"""The one reading of a DeepSpeed config dict, shared by the running plugin (`probe`) and `trl-gc-check`. Pure.
Read from the sources of DeepSpeed 0.19.8, accelerate 1.x and transformers 5.23:

- `zero_optimization`: absent means `{}` (stage 0). Not a mapping is a problem: DeepSpeed raises on `null`, a
  string, a list; accelerate's `DeepSpeedPlugin` (every Hugging Face run) fails on the pre-0.3 `true` / `false`.
- `stage`: pydantic lax int 0-3 (also `3.0`, `"3"`, `" 3"`); `"auto"` is filled by accelerate before DeepSpeed sees
  it (`ACCELERATE_DEEPSPEED_ZERO_STAGE`, else 2), so it reads as `auto_stage`. A boolean is a problem
  (transformers' `is_zero3()` compares with `== 3`).
- `overlap_comm`: unset (absent, `null`, `"auto"`, which DeepSpeed drops) becomes `stage == 3`; a set one is
  pydantic's lax bool (`pydantic_bool`), anything else a problem.
- `activation_checkpointing`: DeepSpeed reads six keys with a plain `dict.get` and tests each for truth, so the block
  asks for something when one holds a truthy value (`"false"` counts, `number_checkpoints: 0` does not); not a
  mapping is a problem.
- `stage3_max_reuse_distance` + `stage3_prefetch_bucket_size` (`gather_window`): beside the module computing, ZeRO-3
  holds at most their sum gathered (`__params_to_release`; `tests/test_zero12.py`); a value not a number >= 0
  (`"auto"`) reads as the default.

`problems` are values the run would fail on; a fact a problem hides is None (stage, then overlap_comm).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._base.flags import pydantic_bool
from .._base.report import short
from .errors import type_name

ACTIVATION_CHECKPOINTING_KEYS = (
    "partition_activations",
    "contiguous_memory_optimization",
    "cpu_checkpointing",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
)
"""The keys DeepSpeed's `DeepSpeedActivationCheckpointingConfig` reads (`ACT_CHKPT_DEFAULT`)."""

ZERO3_WINDOW_DEFAULTS = {"stage3_max_reuse_distance": 1_000_000_000, "stage3_prefetch_bucket_size": 50_000_000}
"""DeepSpeed's defaults of the two keys that bound what ZeRO-3 holds gathered (`DeepSpeedZeroConfig`, 0.19.8)."""

ACCELERATE_DEFAULT_STAGE = 2
"""The stage accelerate's `DeepSpeedPlugin` puts in place of `"auto"` without `ACCELERATE_DEEPSPEED_ZERO_STAGE`."""


@dataclass(frozen=True)
class DeepSpeedFacts:
    """What a DeepSpeed config means for checkpointing (module docstring); `problems` each start with the key."""

    stage: int | None
    activation_checkpointing: bool
    overlap_comm: bool | None
    problems: tuple[str, ...] = ()
    stage_auto: bool = False
    gather_window: int = sum(ZERO3_WINDOW_DEFAULTS.values())


def _gather_window(zero: Mapping[str, Any] | None) -> int:
    """`stage3_max_reuse_distance` + `stage3_prefetch_bucket_size`, each DeepSpeed's default unless a number >= 0."""
    total = 0
    for key, default in ZERO3_WINDOW_DEFAULTS.items():
        value = zero.get(key) if zero is not None else None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        total += int(value) if ok else default
    return total


def _got(value: Any) -> str:
    return f"{type_name(value)} {short(value)}"


def _stage(raw: Any) -> int | None:
    """pydantic's lax reading of an `int` enum, less booleans: the stage, or None when it is not 0-3."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, str):
        try:
            raw = float(raw.strip())
        except ValueError:
            return None
    return int(raw) if isinstance(raw, int | float) and raw in (0, 1, 2, 3) else None


def deepspeed_facts(config: Mapping[str, Any], auto_stage: int = ACCELERATE_DEFAULT_STAGE) -> DeepSpeedFacts:
    """The facts of the DeepSpeed config `config` (a parsed JSON object); `auto_stage` is the stage `"auto"` becomes."""
    problems: list[str] = []
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        problems.append(f"key 'zero_optimization': expected a mapping such as {{stage: 3}}, got {_got(zero)}")
        zero = None
    elif any(not isinstance(k, str) for k in zero):
        bad = next(k for k in zero if not isinstance(k, str))
        problems.append(f"key 'zero_optimization': keys must be strings, got {_got(bad)}")

    stage: int | None = None
    stage_auto = False
    if zero is not None:
        raw = zero.get("stage", 0)
        if raw == "auto":
            stage, stage_auto = auto_stage, True
        else:
            stage = _stage(raw)
            if stage is None:
                problems.append(f"key 'zero_optimization.stage': must be 0, 1, 2 or 3, got {short(raw)}")

    overlap: bool | None = None
    raw_overlap = zero.get("overlap_comm") if zero is not None else None
    if raw_overlap is None or raw_overlap == "auto":
        overlap = None if stage is None else stage == 3
    else:
        overlap = pydantic_bool(raw_overlap)
        if overlap is None:
            problems.append(f"key 'zero_optimization.overlap_comm': expected true or false, got {_got(raw_overlap)}")

    block = config.get("activation_checkpointing", {})
    ac = False
    if isinstance(block, Mapping):
        ac = any(bool(block.get(k)) for k in ACTIVATION_CHECKPOINTING_KEYS)
    else:
        problems.append(f"key 'activation_checkpointing': expected a mapping, got {_got(block)}")
    return DeepSpeedFacts(
        stage=stage,
        activation_checkpointing=ac,
        overlap_comm=overlap,
        problems=tuple(problems),
        stage_auto=stage_auto,
        gather_window=_gather_window(zero),
    )
