"""The launchers the check reads, by format name: each module has `MARKERS` (the keys that tell its configs, `detect`)
and `STRONG_MARKERS` (those that decide the format even beside another launcher's weaker markers), `READ_KEYS` (the keys it reads, `load`) and `read(config, ctx) -> Reading`."""

from __future__ import annotations

from types import ModuleType

from . import axolotl, llamafactory, openrlhf, training_args, trl

LAUNCHERS: dict[str, ModuleType] = {
    "trl": trl,
    "axolotl": axolotl,
    "llamafactory": llamafactory,
    "openrlhf": openrlhf,
    "training-args": training_args,
}
NAMES = {"trl": "TRL", "axolotl": "Axolotl", "llamafactory": "LLaMA-Factory", "openrlhf": "OpenRLHF"}
"""How the check's messages name each launcher."""
DETECTED = ("trl", "axolotl", "llamafactory", "openrlhf")
"""The formats `detect` tells by marker keys (a plain arguments file is told by its fields)."""
