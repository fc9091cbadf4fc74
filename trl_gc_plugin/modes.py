"""The plugin's modes and how the mode is chosen (stdlib only)."""

from __future__ import annotations

import logging
import os
from typing import Literal

Mode = Literal["strict", "fix", "warn"]
MODES: tuple[Mode, ...] = ("strict", "fix", "warn")
MODE_ENV = "TRL_GC_PLUGIN_MODE"

logger = logging.getLogger("trl_gc_plugin")
_warned: set[str] = set()


def parse_mode(value: object) -> Mode | None:
    """A mode from an argument or the environment: case and surrounding blanks ignored; None if it is none."""
    if not isinstance(value, str):
        return None
    text = value.strip().lower()
    return text if text in MODES else None  # type: ignore[return-value]


def resolve_mode(mode: str | None, fallback: Mode | None = None) -> Mode:
    """`mode`, else `fallback` (the mode given to `install()`), else `$TRL_GC_PLUGIN_MODE`, else `strict`.

    The same spellings are accepted everywhere (`"STRICT"`, `" fix "`). A bad argument raises `ValueError`; a bad
    environment value warns once per process and falls back to `strict`.
    """
    if mode is not None:
        parsed = parse_mode(mode)
        if parsed is None:
            raise ValueError(f"mode must be one of {', '.join(MODES)} (any case); got {mode!r}")
        return parsed
    if fallback is not None:
        return fallback
    env = os.environ.get(MODE_ENV, "")
    if not env.strip():
        return "strict"
    parsed = parse_mode(env)
    if parsed is not None:
        return parsed
    if env not in _warned:
        _warned.add(env)
        logger.warning("%s=%r is not one of %s; using 'strict'.", MODE_ENV, env, ", ".join(MODES))
    return "strict"
