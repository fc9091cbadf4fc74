"""Spelling of on/off values in environment variables and configs, and the launcher's rank (stdlib only: `_startup`
uses it)."""

from __future__ import annotations

import os

ON = frozenset({"1", "true", "yes", "on", "t", "y"})
OFF = frozenset({"0", "false", "no", "off", "f", "n"})
FORMS = "True/False, 1/0, or a string yes/no, true/false, t/f, y/n, 1/0, on/off (any case)"


def parse_flag(value: object) -> bool | None:
    """True/False for a bool, 0/1, or a string in ON/OFF (any case, blanks ignored); None otherwise (empty included).
    The one spelling of every on/off setting."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ON:
            return True
        if text in OFF:
            return False
    return None


def launcher_main_process() -> bool:
    """False on the ranks other than 0 of a distributed launch (the launcher's `RANK`, else `LOCAL_RANK`)."""
    value = os.environ.get("RANK") or os.environ.get("LOCAL_RANK")
    try:
        return int(value) == 0 if value else True
    except ValueError:
        return True


def pydantic_bool(value: object) -> bool | None:
    """How pydantic v2 validates a `bool` in lax mode (Axolotl's schema): `parse_flag`'s values and 0.0/1.0, but no
    blanks around a string; None when pydantic would refuse the value."""
    if isinstance(value, float) and value in (0.0, 1.0):
        return bool(value)
    if isinstance(value, str) and value != value.strip():
        return None
    return parse_flag(value)
