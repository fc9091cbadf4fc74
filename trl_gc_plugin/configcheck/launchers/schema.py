"""Launchers as data (issue 45): the keys a launcher reads (`Key`: its spellings, type and default) and its
use_reentrant rewrite ladder (`Step`: a condition on what was read -> the value, its origin and why), each run by one
interpreter here (`read_keys`, `rewrite`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..read.common import Config, ConfigError, Origin, Reentrant, short, type_name, where

Kind = Callable[[Config, str, Any], Any]
"""A key's type (`Key.kind`): (config, name, value) -> the typed value, or `ConfigError` as the launcher refuses it."""


class Values(dict[str, Any]):
    """What `read_keys` read, by field (`values.field`), with the spelling the file used as `field_name` (None: the
    default), and the names it was filled with; a `str.format_map` mapping for `Step.why`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class Key:
    """A key a launcher reads: `field` (the name its code and steps use), `names` (its spellings, the first the file
    has wins: the current name before its old aliases; `{...}` filled by `read_keys`), `kind` (the type: a function
    of (config, name, value) that returns the typed value or raises `ConfigError` as the launcher refuses it), and
    `default` (the launcher's value when the file has none)."""

    field: str
    names: tuple[str, ...]
    kind: Kind
    default: Any = None


def checked(test: Callable[[Any], Any], refusal: str, convert: Callable[[Any], Any] = lambda v: v) -> Kind:
    """A `Key.kind` from a test and the launcher's refusal (most keys' kinds; one that needs more is a function): the
    value, `convert`ed, where `test(value)` holds, else `ConfigError` `<path>: key <name> (line n): <refusal>`, with
    `{type}` and `{value}` filled (the value's type, the value shortened)."""

    def kind(config: Config, name: str, value: Any) -> Any:
        if test(value):
            return convert(value)
        message = refusal.format(type=type_name(value), value=short(value))
        raise ConfigError(f"{where(config.path, name, config.lines)}: {message}")

    return kind


def as_given(config: Config, name: str, value: Any) -> Any:
    """A `Key.kind` for a value the launcher takes as written (it converts and refuses nothing)."""
    return value


@dataclass(frozen=True)
class Noted:
    """What a kind returns for a value the launcher takes its own way (TRL passes a non-boolean through): the typed
    value, and the note the reading says about it."""

    value: Any
    note: str


def read_keys(
    config: Config, keys: Iterable[Key], absent: Iterable[str] = (), notes: list[str] | None = None, **fill: Any
) -> Values:
    """`keys` typed from `config`, in order (the first refusal is the launcher's); a name in `absent` counts as
    not given (a value that could not be read); the kinds' notes (`Noted`) go to `notes`, in order."""
    out, absent, notes = Values(fill), set(absent), [] if notes is None else notes
    for key in keys:
        names = [n.format(**fill) for n in key.names]
        name = next((n for n in names if n in config.values and n not in absent), None)
        value = key.default if name is None else key.kind(config, name, config.values[name])
        if isinstance(value, Noted):
            notes.append(value.note)
            value = value.value
        out[key.field], out[f"{key.field}_name"] = value, name
    return out


@dataclass(frozen=True)
class Step:
    """One rung of a launcher's use_reentrant ladder: where `when(values, reentrant)` holds, use_reentrant becomes
    `value` (a constant, or a function of the values) with `origin`, and `why` (a `str.format_map` template over the
    values). `kwargs`: the step writes use_reentrant into the kwargs too (a validator's rewrite of the config, not
    only the value a trainer passes). The steps apply in order, a later one over an earlier one."""

    when: Callable[[Values, Reentrant], Any]
    value: Any
    why: str
    origin: Origin = "launcher rewrite"
    kwargs: bool = False


def rewrite(steps: Iterable[Step], values: Values, reentrant: Reentrant) -> Reentrant:
    """`reentrant` once each step whose condition holds has rewritten it (the ladder's interpreter)."""
    for step in steps:
        if step.when(values, reentrant):
            value = step.value(values) if callable(step.value) else step.value
            reentrant.rewrite(value, step.why.format_map(values), step.origin)
            if step.kwargs:
                reentrant.kwargs = {**(reentrant.kwargs or {}), "use_reentrant": value}
    return reentrant
