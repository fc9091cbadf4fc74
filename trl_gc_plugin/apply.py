"""Carry out decisions: write them into the arguments (both field names, one dict object) and the live model.

Only decisions with `applied=True` are carried out; the engine never marks `error` or `warn` decisions so.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from . import probe
from .decisions import Decision

USE_CACHE_ATTR = "_trl_gc_plugin_use_cache"


def write_kwargs(args: Any, kwargs: dict[str, Any] | None) -> None:
    """Store `kwargs` in every kwargs field the args have, as one object (so later in-place edits reach both)."""
    value = dict(kwargs) if kwargs is not None else None
    for name in (probe.NEW_KWARGS, probe.OLD_KWARGS):
        if name in getattr(type(args), "__dataclass_fields__", {}):
            setattr(args, name, value)


def write_flag(args: Any, value: bool) -> None:
    for name in (probe.NEW_FLAG, probe.OLD_FLAG):
        if name in getattr(type(args), "__dataclass_fields__", {}):
            setattr(args, name, value)


def set_args_use_reentrant(args: Any, value: bool | None) -> None:
    """Set `use_reentrant` in the kwargs the Trainer reads, keeping every other key (`every_n_layers`, ...)."""
    kwargs = dict(probe.read_kwargs(args) or {})
    if value is None:
        kwargs.pop("use_reentrant", None)
    else:
        kwargs["use_reentrant"] = value
    write_kwargs(args, kwargs)


def set_model_use_reentrant(model: Any, value: bool) -> int:
    """Rewrite the checkpoint function of every checkpointing module of `model` to run with `use_reentrant=value`.

    The `functools.partial` transformers stores is rebuilt with the same function and other keywords, so
    `every_n_layers`, offloading and any torch kwargs survive, and no hook is added. Returns how many modules
    changed.
    """
    changed = 0
    for module, func in probe.checkpoint_functions(probe.unwrap(model)):
        if isinstance(func, functools.partial):
            if func.keywords.get("use_reentrant") is value:
                continue
            new = functools.partial(func.func, *func.args, **{**func.keywords, "use_reentrant": value})
        else:
            new = functools.partial(func, use_reentrant=value)
        module._gradient_checkpointing_func = new
        changed += 1
    return changed


def set_use_cache(model: Any, value: bool) -> None:
    """Set `model.config.use_cache`, remembering the first value seen so `restore_use_cache` can put it back."""
    config = getattr(probe.unwrap(model), "config", None)
    if config is None:
        return
    if USE_CACHE_ATTR not in config.__dict__:
        config.__dict__[USE_CACHE_ATTR] = config.use_cache
    config.use_cache = value


def restore_use_cache(model: Any) -> bool:
    """Undo `set_use_cache`; True if something was restored."""
    config = getattr(probe.unwrap(model), "config", None)
    if config is None or USE_CACHE_ATTR not in config.__dict__:
        return False
    config.use_cache = config.__dict__.pop(USE_CACHE_ATTR)
    return True


def apply(decisions: Iterable[Decision], args: Any, model: Any = None) -> list[Decision]:
    """Carry out the applicable decisions on `args` (and `model` when given). Returns those carried out."""
    done = []
    for d in decisions:
        if not d.applied:
            continue
        if d.setting == "use_reentrant":
            set_args_use_reentrant(args, d.after)
        elif d.setting == probe.NEW_KWARGS:  # the deprecated name was written last: it wins
            old = getattr(args, probe.OLD_KWARGS, None)
            write_kwargs(args, old if isinstance(old, dict) else None)
        elif d.setting == probe.OLD_KWARGS:  # the new name was written last: the old names mirror it
            write_kwargs(args, probe.read_kwargs(args))
            write_flag(args, bool(getattr(args, probe.NEW_FLAG, False)))
        elif d.setting == probe.NEW_FLAG:
            write_flag(args, bool(d.after))
        elif d.setting == "model.use_reentrant":
            if model is None:
                continue
            set_model_use_reentrant(model, bool(d.after))
        elif d.setting == "model.config.use_cache":
            if model is None:
                continue
            set_use_cache(model, bool(d.after))
        else:
            raise KeyError(f"no way to apply a decision on {d.setting!r}")
        done.append(d)
    return done
