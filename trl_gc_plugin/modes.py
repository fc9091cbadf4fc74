"""The plugin's modes and how the mode is chosen (stdlib only)."""

from __future__ import annotations

import logging
import os
from typing import Literal

Mode = Literal["strict", "fix", "warn"]
MODES: tuple[Mode, ...] = ("strict", "fix", "warn")
MODE_ENV = "TRL_GC_PLUGIN_MODE"

logger = logging.getLogger("trl_gc_plugin")


def resolve_mode(mode: str | None) -> Mode:
    """`mode`, else `$TRL_GC_PLUGIN_MODE`, else `strict`. A bad argument raises; a bad env value warns."""
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        return mode  # type: ignore[return-value]
    env = os.environ.get(MODE_ENV, "").strip().lower()
    if not env:
        return "strict"
    if env in MODES:
        return env  # type: ignore[return-value]
    logger.warning("%s=%r is not one of %s; using 'strict'.", MODE_ENV, env, ", ".join(MODES))
    return "strict"
