"""The context-parallel size of accelerate's `ParallelismConfig`, as the run and `trl-gc-check` both read it: from
`TrainingArguments.parallelism_config` (transformers >= 4.56), the environment `accelerate launch` (and Axolotl's
`context_parallel_size`) exports, or an accelerate config file's `parallelism_config:` block."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._base.flags import parse_flag

KEY = "parallelism_config_cp_size"
"""The accelerate name of the context-parallel size: a config block's key; upper-cased, the environment variable."""

USE_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"
"""Set by `accelerate launch` when the config has a `parallelism_config` block: `Accelerator()` then builds one."""

EVIDENCE = (
    "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/utils/launch.py "
    "(prepare_extend_env_parallelism_config: PARALLELISM_CONFIG_CP_SIZE)",
    "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/parallelism_config.py "
    "(cp_size from PARALLELISM_CONFIG_CP_SIZE; cp_enabled: cp_size > 1)",
)


def cp_size_of(block: Mapping[str, Any]) -> int | None:
    """The context-parallel size a `parallelism_config` block (accelerate's key names, any case) gives: 1 when it
    does not say, None when the value is not a whole number >= 1 (accelerate refuses it)."""
    value = next((v for k, v in block.items() if str(k).lower() == KEY), 1)
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and value >= 1 else None


def cp_size_from_env(env: Mapping[str, str] | None = None) -> int:
    """The size `Accelerator()` will read from the environment (1 without `ACCELERATE_USE_PARALLELISM_CONFIG`)."""
    env = os.environ if env is None else env
    if parse_flag(env.get(USE_ENV, "")) is not True:
        return 1
    return cp_size_of({KEY: env.get(KEY.upper(), "1")}) or 1


def cp_size_from_args(args: Any, env: Mapping[str, str] | None = None) -> int:
    """The run's context-parallel size: the arguments' `parallelism_config` object, else the environment."""
    config = getattr(args, "parallelism_config", None)
    size = getattr(config, "cp_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return size
    return cp_size_from_env(env)
