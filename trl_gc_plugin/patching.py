"""Patches, all reversible: `TrainingArguments.__post_init__`, and the callback in `DEFAULT_CALLBACKS`.

`install()` wraps `TrainingArguments.__post_init__` (every subclass - `SFTConfig`, `DPOConfig`, `GRPOConfig`... -
runs it through `super().__post_init__()` or inherits it), so the safe `use_reentrant` is in the arguments from
construction, before any trainer reads them; and it appends `SafeGCCallback` to `transformers.trainer.DEFAULT_CALLBACKS`,
the list every `Trainer` (and every TRL trainer) starts from. `uninstall()` puts back exactly what was there.
Importing `trl_gc_plugin` does none of this.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

from . import probe
from .apply import apply
from .decisions import is_main_process, log_decisions
from .engine import Mode, decide, errors, final_use_reentrant
from .errors import GCConfigError

logger = logging.getLogger("trl_gc_plugin")

_MARK = "__trl_gc_plugin_wrapper__"
_lock = threading.RLock()
_state: dict[str, Any] = {"original": None, "mode": None, "callback": None}


def _user_use_reentrant(args: Any) -> tuple[bool, Any]:
    """Whether the user's own kwargs (before `__post_init__`) set `use_reentrant`, and to what."""
    for name in (probe.NEW_KWARGS, probe.OLD_KWARGS):
        value = args.__dict__.get(name)
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except ValueError:
                continue
        if isinstance(value, dict):
            return ("use_reentrant" in value, value.get("use_reentrant"))
    return (False, None)


def post_init_decide(args: Any, mode: Mode, user_given: bool, user_value: Any) -> list[Any]:
    """What the patched `__post_init__` runs once the original has: decide on the arguments alone, apply, record."""
    args.__dict__[probe.RECORD_ATTR] = probe.PostInitRecord(user_given=user_given, user_value=user_value)
    facts = probe.facts_from_args(args, stage="post_init")
    if not facts.gc_enabled:
        return []
    decisions = decide(facts, mode)
    log_decisions(decisions, is_main_process())
    raise_for_errors(decisions, mode)
    apply(decisions, args)
    probe.remember(args, *final_use_reentrant(decisions, facts.use_reentrant, facts.use_reentrant_source), decisions)
    return decisions


def raise_for_errors(decisions: list[Any], mode: str) -> None:
    """Raise `GCConfigError` for the `error` decisions (never in warn mode)."""
    bad = errors(decisions)
    if not bad or mode == "warn":
        return
    lines = [f"trl_gc_plugin refused this gradient-checkpointing setup (mode={mode}):"]
    for d in bad:
        lines.append(f"- [{d.rule_id}] {d.setting}={d.before!r}: {d.reason}")
        if d.after is not None:
            lines.append(
                f"  Change: gradient_checkpointing_kwargs={{'use_reentrant': {d.after!r}}} "
                "(activation_checkpointing_kwargs on transformers >= 5.23)."
            )
        if d.evidence:
            lines.append("  Evidence: " + "; ".join(d.evidence))
    lines.append(
        "To let the plugin change such values instead of refusing, use SafeGCCallback(mode='fix') or "
        "TRL_GC_PLUGIN_MODE=fix; `python -m trl_gc_plugin rules` lists every rule."
    )
    raise GCConfigError("\n".join(lines), bad)


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def __post_init__(self: Any, *a: Any, **kw: Any) -> Any:
        user_given, user_value = _user_use_reentrant(self)
        result = original(self, *a, **kw)
        mode = _state["mode"]
        if mode is not None:  # uninstalled while an old reference was still around: behave as the original
            post_init_decide(self, mode, user_given, user_value)
        return result

    setattr(__post_init__, _MARK, True)
    return __post_init__


def install(mode: str | None = None, callback: bool = True) -> None:
    """Patch `TrainingArguments.__post_init__` and register `SafeGCCallback` for every Trainer.

    Idempotent: a second call only updates the mode. Undo with `uninstall()`.

    Args:
        mode (`str`, *optional*): `strict`, `fix` or `warn`; defaults to `TRL_GC_PLUGIN_MODE`, then `strict`.
        callback (`bool`, *optional*, defaults to `True`): also append the callback to
            `transformers.trainer.DEFAULT_CALLBACKS`, so every Trainer built afterwards gets it.

    Example:
        ```python
        import trl_gc_plugin
        trl_gc_plugin.install()
        args = SFTConfig(output_dir="out")  # gradient_checkpointing_kwargs == {"use_reentrant": False}
        ```
    """
    from transformers import TrainingArguments

    from .callback import resolve_mode

    with _lock:
        _state["mode"] = resolve_mode(mode)
        current = TrainingArguments.__dict__["__post_init__"]
        if not getattr(current, _MARK, False):
            _state["original"] = current
            TrainingArguments.__post_init__ = _wrap(current)  # type: ignore[method-assign]
        if callback:
            register_callback()


def register_callback() -> None:
    """Append `AutoSafeGCCallback` to `transformers.trainer.DEFAULT_CALLBACKS` (in place, once)."""
    import transformers.trainer as trainer_module

    from .callback import AutoSafeGCCallback

    with _lock:
        defaults = trainer_module.DEFAULT_CALLBACKS
        if AutoSafeGCCallback not in defaults:
            defaults.append(AutoSafeGCCallback)
        _state["callback"] = AutoSafeGCCallback


def uninstall() -> None:
    """Undo `install()`: restore the original `__post_init__` and remove the callback from `DEFAULT_CALLBACKS`."""
    import sys

    with _lock:
        original = _state["original"]
        tf_args = sys.modules.get("transformers.training_args")
        if original is not None and tf_args is not None:
            cls = tf_args.TrainingArguments
            if getattr(cls.__dict__.get("__post_init__"), _MARK, False):
                cls.__post_init__ = original
            else:
                logger.warning("TrainingArguments.__post_init__ was re-patched by someone else; left as it is.")
        _state["original"] = None
        _state["mode"] = None
        trainer_module = sys.modules.get("transformers.trainer")
        if trainer_module is not None and _state["callback"] is not None:
            defaults = trainer_module.DEFAULT_CALLBACKS
            while _state["callback"] in defaults:
                defaults.remove(_state["callback"])
        _state["callback"] = None


def is_installed() -> bool:
    """Whether the `__post_init__` patch is in place."""
    return _state["original"] is not None


@contextlib.contextmanager
def installed(mode: str | None = None, callback: bool = True) -> Iterator[None]:
    """`install()` for the duration of a `with` block (tests, notebooks); restores the previous state."""
    was, old_mode, had_cb = is_installed(), _state["mode"], _state["callback"] is not None
    install(mode, callback=callback)
    try:
        yield
    finally:
        if was:
            _state["mode"] = old_mode
            if not had_cb and callback:
                import transformers.trainer as trainer_module

                from .callback import AutoSafeGCCallback

                while AutoSafeGCCallback in trainer_module.DEFAULT_CALLBACKS:
                    trainer_module.DEFAULT_CALLBACKS.remove(AutoSafeGCCallback)
                _state["callback"] = None
        else:
            uninstall()
