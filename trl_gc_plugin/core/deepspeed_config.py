"""The one reading of a DeepSpeed config dict, shared by the running plugin (`probe`) and `trl-gc-check`
(`launchers.deepspeed`), so that both judge the same file the same way. Pure: no torch / transformers / deepspeed.

What each fact means, decided from the sources of DeepSpeed 0.19.8, accelerate 1.x and transformers 5.23 (the paths
are inside the installed packages):

- `zero_optimization`: absent means `{}` (`deepspeed/runtime/zero/config.py` `get_zero_config`), so stage 0.
  Anything but a mapping is a problem: `null`, a string, a list make DeepSpeed's `DeepSpeedZeroConfig(**value)` raise
  a TypeError; DeepSpeed still reads the pre-0.3 `true` / `false` form, but accelerate's `DeepSpeedPlugin`, which
  every Hugging Face run goes through (`transformers/training_args.py` builds one from the config), fails on it
  first (`'bool' object has no attribute 'get'` in `fill_match`). (accelerate also refuses a config with no
  `zero_optimization` at all, "Please specify the ZeRO optimization config"; this reader keeps DeepSpeed's stage 0
  there and does not report it.)
- `stage`: `DeepSpeedZeroConfig.stage: ZeroStageEnum = 0`, validated by pydantic in lax mode: 0-3, also as an
  integral float (`3.0`) or a string of one (`"3"`, `" 3"`, `"3.0"`). `"auto"` is the stage accelerate fills in
  (`accelerate/utils/dataclasses.py` `DeepSpeedPlugin.__post_init__`: `fill_match("zero_optimization.stage")` with
  its `zero_stage`, `ACCELERATE_DEEPSPEED_ZERO_STAGE` else 2) before DeepSpeed sees the config; transformers'
  `integrations/deepspeed.py` fills other `auto` keys, never the stage. So `"auto"` reads as `auto_stage` (2 unless
  the caller knows the plugin's value). A boolean is a problem although pydantic would take `true` as 1 (a JSON
  boolean stage is a mistake, and transformers' `is_zero3()` compares with `== 3`); so is anything else.
- `overlap_comm`: `Optional[bool] = None`, then the validator `overlap_comm_valid` sets an unset one to
  `stage == 3`. Unset means absent, `null`, or `"auto"` (`deepspeed/runtime/config_utils.py`
  `DeepSpeedConfigModel.__init__` drops every `"auto"` value, and neither accelerate nor transformers fills this
  key). A set one is pydantic's lax bool (`_flags.pydantic_bool`: true/false, 0/1, 0.0/1.0, and the strings
  1/on/t/true/y/yes, 0/off/f/false/n/no in any case, unstripped); anything else (`2`, `"maybe"`, `" true"`) is a
  problem. So the fact is what DeepSpeed runs with: True under ZeRO-3 unless turned off, False under 0-2 unless on.
- `activation_checkpointing`: `deepspeed/runtime/activation_checkpointing/config.py` reads six keys
  (`ACTIVATION_CHECKPOINTING_KEYS`) with `get_scalar_param` (a plain `dict.get`, no conversion) and ignores any other
  key; the block must be a mapping (`null` or a list raise AttributeError in `DeepSpeedConfig`), else a problem.
  `checkpointing.py` then tests each value for truth (`if PARTITION_ACTIVATIONS:`), and every default is False or
  None. So the block asks for something when one of the six keys holds a truthy value: `"false"` (a non-empty
  string) counts, as DeepSpeed would partition with it; `number_checkpoints: 0` does not, 4 does; an unknown key
  alone does not.
- `stage3_max_reuse_distance`, `stage3_prefetch_bucket_size` (numbers of elements, defaults 1e9 and 5e7 in
  `deepspeed/runtime/zero/config.py`): after a submodule's forward or backward, ZeRO-3 releases its gathered
  parameters except those used again within the reuse distance of the module trace ahead
  (`partitioned_param_coordinator.py` `__params_to_release`), and it gathers ahead up to the prefetch bucket. So
  besides the module computing, at most their sum (`gather_window`) is held whole: on a model smaller than 1e9
  elements, every parameter once the trace is complete (measured: `tests/test_zero12.py`). A value that is not a
  number >= 0 (`"auto"`, which transformers fills for the prefetch bucket at run time) reads as the default; this
  fact only sizes a memory plan, and DeepSpeed reports a bad value itself.

`problems` are messages about values the run would fail on (DeepSpeed or accelerate raise); the check turns them
into its `ConfigError`, the runtime logs them and reads the rest. A fact a problem hides is None (stage, and then
overlap_comm, which depends on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._base.flags import pydantic_bool
from .errors import short, type_name

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
    """What a DeepSpeed config means for checkpointing (see the module docstring for each rule's evidence).

    Args:
        stage: the ZeRO stage DeepSpeed runs, 0-3; None when a problem hides it.
        activation_checkpointing: the `activation_checkpointing` block sets one of DeepSpeed's six keys to a truthy
            value.
        overlap_comm: `zero_optimization.overlap_comm` as DeepSpeed resolves it (unset: `stage == 3`); None when a
            problem hides it.
        problems: messages about values the run would fail on, each starting with the key (`key 'x': ...`).
        stage_auto: the stage was `"auto"`, read as the stage accelerate fills in.
        gather_window: under ZeRO-3, the most parameter elements held gathered besides the module computing (reuse
            distance + prefetch bucket).
    """

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
    if isinstance(raw, int):
        return raw if raw in (0, 1, 2, 3) else None
    number = raw
    if isinstance(raw, str):
        try:
            number = float(raw.strip())
        except ValueError:
            return None
    if isinstance(number, float) and number in (0.0, 1.0, 2.0, 3.0):
        return int(number)
    return None


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
