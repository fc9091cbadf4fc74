"""Spelling of on/off values in environment variables and configs (stdlib only: `_startup` uses it)."""

from __future__ import annotations

ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"", "0", "false", "no", "off"})


def parse_flag(value: object) -> bool | None:
    """True/False for a bool, 0/1, or a string in ON/OFF (any case, surrounding blanks ignored); None otherwise."""
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
