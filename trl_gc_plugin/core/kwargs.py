"""The Trainer's checkpointing kwargs as a vocabulary: which keys something reads (torch, transformers, the plugin),
which it does not, and what is wrong with them as a container. Turned into facts (`kwargs_unknown`,
`kwargs_problem`) by `model.probe` and the checker; read by the rules and the writers."""

from __future__ import annotations

import difflib
from typing import Any

from .._base.report import short
from .capabilities import torch_checkpoint_keywords

LAYER_KWARGS = ("every_n_layers", "offload")
"""Checkpointing kwargs that transformers reads itself where it can (5.16: every_n_layers; 5.17: offload too)."""


def known_checkpoint_keys() -> frozenset[str]:
    """Every key of the checkpointing kwargs that something reads: torch, transformers (`LAYER_KWARGS`), the plugin
    (TRL's `selective: true`)."""
    return torch_checkpoint_keywords() | frozenset(LAYER_KWARGS) | {"selective"}


def unknown_checkpoint_names(keys: Any) -> tuple[str, ...]:
    """The keys nothing reads, as written."""
    known = known_checkpoint_keys()
    return tuple(sorted(str(key) for key in keys if str(key) not in known))


def unknown_checkpoint_keys(keys: Any) -> tuple[str, ...]:
    """The keys nothing reads, each with the nearest known key when one is close (`use_reentrent (did you mean
    use_reentrant?)`)."""
    known = sorted(known_checkpoint_keys())
    out = []
    for name in unknown_checkpoint_names(keys):
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        out.append(f"{name} (did you mean {near[0]}?)" if near else name)
    return tuple(sorted(out))


def checkpoint_kwargs_problem(value: Any) -> str | None:
    """What is wrong with the checkpointing kwargs as a container (None: a dict, or unset); e.g.
    `str 'use_reentrant=True'`. transformers parses a JSON string itself in `__post_init__`; what is left a string
    here is not JSON."""
    if value is None or isinstance(value, dict):
        return None
    return f"{type(value).__name__} {short(value)}"
