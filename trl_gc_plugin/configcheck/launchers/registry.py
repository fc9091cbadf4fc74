"""The launchers the check reads, by format name. Each module has `MARKERS` (keys only its configs use),
`STRONG_MARKERS` (those that decide beside another launcher's markers), `READ_KEYS` and `read(config, ctx)`."""

from __future__ import annotations

from types import ModuleType

from . import axolotl, llamafactory, openrlhf, training_args, trl, verl

LAUNCHERS: dict[str, ModuleType] = {
    "trl": trl,
    "axolotl": axolotl,
    "llamafactory": llamafactory,
    "openrlhf": openrlhf,
    "verl": verl,
    "training-args": training_args,
}
NAMES = {"trl": "TRL", "axolotl": "Axolotl", "llamafactory": "LLaMA-Factory", "openrlhf": "OpenRLHF", "verl": "verl"}
"""How messages name the launchers `detect` tells by marker keys (a plain arguments file is told by its fields)."""
