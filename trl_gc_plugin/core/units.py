"""Byte sizes: `parse_size` reads the sizes a memory budget is given in, `format_bytes` writes one for a message."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_UNITS.update({f"{u}ib": size for u, size in list(_UNITS.items()) if u in "kmgt" and u})
_UNITS.update({f"{u}b": 10 ** (3 * (i + 1)) for i, u in enumerate("kmgt")})
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
BUDGET_FORMS = (
    "a whole number of bytes or a size such as 40GiB, 512MiB, 1.5GB, 800M (KiB/MiB/GiB/TiB, KB/MB/GB/TB; K/M/G/T = "
    "KiB/MiB/GiB/TiB)"
)


def parse_size(text: str | int | float) -> int:
    """Bytes from a size (`40GiB`, `1.5GB`, `800M`, an int or float of bytes; K/M/G/T binary, KB..TB decimal); a
    number of bytes must be whole. `ValueError` naming the accepted forms for anything else."""
    match = _SIZE.match(text) if isinstance(text, str) else None
    if isinstance(text, int | float) and not isinstance(text, bool):
        value, unit = float(text), ""
    elif match is not None and match.group(2).lower() in _UNITS:
        value, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ValueError(f"memory budget: expected {BUDGET_FORMS}; got {text!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"memory budget: must be a positive size ({BUDGET_FORMS}); got {text!r}")
    if _UNITS[unit] == 1 and not value.is_integer():
        raise ValueError(f"memory budget: a number of bytes must be whole ({BUDGET_FORMS}); got {text!r}")
    return max(round(value * _UNITS[unit]), 1)


def format_bytes(n: float) -> str:
    """`12.3 GiB`, `512.0 MiB`, ... (binary units)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
