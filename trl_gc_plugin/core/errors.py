"""The one deliberate error of trl_gc_plugin, `GCConfigError`, and its message (what to change, and why); the CLIs'
`UsageError` (exit status 2); the one
rule for every other error (`contained`: a plugin bug never stops training); how a message names the type of a value
it found (`type_name`; `_base.report.short` quotes the value)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._base import report

if TYPE_CHECKING:
    from .decisions import Decision


def type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


class UsageError(ValueError):
    """Input a command line cannot use: an invalid option, or a file it reads that is unreadable, malformed or of no
    known format. The one exception for exit status 2: `trl-gc-check` and `trl-gc-plan` print its message (one line)
    and return 2 (`configcheck`'s `ConfigError` is this class; a file's becomes that file's error)."""


class GCConfigError(ValueError):
    """A gradient-checkpointing configuration known to break training, raised in `strict` mode before the first
    training step; `decisions` holds the `error` decisions behind the message."""

    def __init__(self, message: str, decisions: list[Decision] | None = None) -> None:
        super().__init__(message)
        self.decisions: list[Decision] = list(decisions or [])


def raise_for_errors(decisions: Sequence[Decision], mode: str) -> None:
    """Raise `GCConfigError` for the `error` decisions (never in warn mode): each rule, the setting to change, the
    evidence, and how to let the plugin change it instead."""
    bad = [d for d in decisions if d.action == "error"]
    if not bad or mode == "warn":
        return
    from .targets import TARGETS  # here: importing the errors loads no rule table

    lines = [f"trl_gc_plugin refused this gradient-checkpointing setup (mode={mode}):"]
    for d in bad:
        lines.append(f"- [{d.rule_id}] {d.reason}")
        change = getattr(TARGETS.get(d.setting), "change", None)
        if change is not None and isinstance(d.after, bool):
            lines.append("  Change: " + change.format(value=d.after) + ".")
        if d.evidence:
            lines.append("  Evidence: " + "; ".join(d.evidence))
    lines.append(
        "To let the plugin change such values instead of refusing, use SafeGCCallback(mode='fix') or "
        "TRL_GC_PLUGIN_MODE=fix; `python -m trl_gc_plugin rules` lists every rule."
    )
    raise GCConfigError("\n".join(lines), bad)


@contextlib.contextmanager
def contained(where: str, on_error: Callable[[Exception], Any] | None = None) -> Iterator[None]:
    """A plugin bug never stops training; a `GCConfigError` always does. Anything else raised inside is handed to
    `on_error` (by default: said as an internal error in `where`) and the caller goes on."""
    try:
        yield
    except GCConfigError:
        raise
    except Exception as exc:
        if on_error is not None:
            with contextlib.suppress(Exception):
                on_error(exc)
            return
        report.note(internal_error(where, exc), "warning")


def internal_error(where: str, exc: Exception) -> str:
    return (
        f"internal error in {where} ({type(exc).__name__}: {exc}); training goes on without the plugin's checks. "
        "Please report it."
    )
