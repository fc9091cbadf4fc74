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
import os
import threading
from collections.abc import Iterator
from typing import Any

from .._base import report
from .._base.flags import parse_flag
from ..core.engine import decide
from ..core.errors import GCConfigError
from ..core.modes import Mode
from ..model import probe
from ..runtime.session import Session

logger = logging.getLogger("trl_gc_plugin")

_MARK = "__trl_gc_plugin_wrapper__"
_lock = threading.RLock()
_state: dict[str, Any] = {"original": None, "mode": None, "callback": None, "budget": None}


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
    """What the patched `__post_init__` runs once the original has: a `Session` on the arguments alone (stage
    `post_init`) decides, refuses or applies and logs, as the callback's stages do; its decisions stay in the
    arguments' record (`probe.PostInitRecord`, outside the object) for the callback to carry on from."""
    record = probe.start_record(args, user_given, user_value)
    facts = probe.facts_from_args(args, stage="post_init")
    if not facts.gc_enabled:
        return []
    report.follow_trainer(args)
    # the distributed state is not read here (`args.process_index` would set it up): the launcher's rank decides
    session = Session(mode, write_json=False, main_process=report.is_main_process())
    session.args, session.final = args, (facts.use_reentrant, facts.use_reentrant_source)
    decisions = decide(facts, mode)
    session.take(decisions, None)
    record.decisions.extend(decisions)
    return decisions


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


def patch_training_args(cls: Any, mode: Mode | None = None) -> None:
    """Wrap `cls.__post_init__` (`transformers.TrainingArguments`); a second call only updates the mode. Without a
    mode (the `TRL_GC_PLUGIN=1` route), the settings layer reads `$TRL_GC_PLUGIN_MODE` alone: a bad value is said
    once, by the main process (the launcher's rank), and `strict` used."""
    if mode is None:
        from ..core.settings import BY_NAME, GCSettings

        env = BY_NAME["mode"].env
        resolved = GCSettings.resolve({}, environ={env: os.environ.get(env, "")}, caller="TRL_GC_PLUGIN=1")
        for line in resolved.problems:
            report.note(f"{line}; using the default.", "warning", report.is_main_process())
        mode = resolved.mode
    with _lock:
        _state["mode"] = mode
        current = cls.__dict__["__post_init__"]
        if not getattr(current, _MARK, False):
            _state["original"] = (cls, current)
            cls.__post_init__ = _wrap(current)


TRACEBACK_ENV = "TRL_GC_PLUGIN_TRACEBACK"


def install_refusal_hook() -> None:
    """For the `TRL_GC_PLUGIN=1` route (launchers: the TRL CLI, `accelerate launch`, LLaMA-Factory): an uncaught
    `GCConfigError` prints its message (which says what to change) instead of a traceback through the launcher's
    argument parsing; any other exception goes to the previous `sys.excepthook`. `TRL_GC_PLUGIN_TRACEBACK=1` shows
    the traceback as well. Undone by `uninstall()`."""
    import sys

    with _lock:
        current = sys.excepthook
        if getattr(current, _MARK, False):
            return

        def excepthook(exc_type: Any, exc: BaseException, tb: Any) -> None:
            if isinstance(exc, GCConfigError) and not parse_flag(os.environ.get(TRACEBACK_ENV, "")):
                sys.stderr.write(
                    f"{exc}\n(trl_gc_plugin stopped the run before training; {TRACEBACK_ENV}=1 shows the traceback)\n"
                )
                return
            current(exc_type, exc, tb)

        setattr(excepthook, _MARK, True)
        excepthook.previous = current  # type: ignore[attr-defined]
        sys.excepthook = excepthook


def _remove_refusal_hook() -> None:
    import sys

    hook = sys.excepthook
    if getattr(hook, _MARK, False):
        sys.excepthook = hook.previous  # type: ignore[attr-defined]


def register_callback(trainer_module: Any = None) -> None:
    """Append `AutoSafeGCCallback` to `transformers.trainer.DEFAULT_CALLBACKS` (in place, once)."""
    if trainer_module is None:
        import transformers.trainer as trainer_module
    from .callback import AutoSafeGCCallback

    with _lock:
        defaults = trainer_module.DEFAULT_CALLBACKS
        if AutoSafeGCCallback not in defaults:
            defaults.append(AutoSafeGCCallback)
        _state["callback"] = (defaults, AutoSafeGCCallback)


def install(mode: str | None = None, callback: bool = True, memory_budget: str | int | None = None) -> None:
    """Patch `TrainingArguments.__post_init__` and register `SafeGCCallback` for every Trainer.

    Idempotent: a second call only updates the mode. Undo with `uninstall()`.

    Args:
        mode (`str`, *optional*): `strict`, `fix` or `warn`; defaults to `TRL_GC_PLUGIN_MODE`, then `strict`.
        callback (`bool`, *optional*, defaults to `True`): also append the callback to
            `transformers.trainer.DEFAULT_CALLBACKS`, so every Trainer built afterwards gets it.
        memory_budget (`str` or `int`, *optional*): the activation-memory budget the registered callback plans
            checkpointing for (see `SafeGCCallback`); defaults to `TRL_GC_PLUGIN_BUDGET`, then no plan.

    Example:
        ```python
        import trl_gc_plugin
        trl_gc_plugin.install()
        args = SFTConfig(output_dir="out")  # gradient_checkpointing_kwargs == {"use_reentrant": False}
        ```
    """
    from transformers import TrainingArguments

    from ..core.settings import BOOL_FORMS, GCSettings, parse_bool

    try:
        callback = parse_bool(callback)
    except ValueError:
        raise GCConfigError(f"install(callback=...): got {callback!r}; callback accepts {BOOL_FORMS}") from None
    resolved = GCSettings.resolve({"mode": mode, "memory_budget": memory_budget}, caller="install")
    for line in resolved.problems:
        report.note(f"{line}; using the default.", "warning")
    with _lock:
        if memory_budget is not None:
            _state["budget"] = resolved.memory_budget
        patch_training_args(TrainingArguments, resolved.mode)
    if callback:
        register_callback()
        from .model_route import patch_enable

        patch_enable()  # loops without a Trainer: the model route (`loop.py`)


def uninstall() -> None:
    """Undo `install()` (or the `TRL_GC_PLUGIN` start-up hook): restore the original `__post_init__` and remove
    the callback from `DEFAULT_CALLBACKS`. Safe to call when nothing is installed."""
    with _lock:
        if _state["original"] is not None:
            cls, original = _state["original"]
            if getattr(cls.__dict__.get("__post_init__"), _MARK, False):
                cls.__post_init__ = original
            else:
                logger.warning("TrainingArguments.__post_init__ was re-patched by someone else; left as it is.")
        _remove_callback()
        _remove_refusal_hook()
        _state.update(original=None, mode=None, budget=None)
    from .model_route import unpatch_enable

    unpatch_enable()


def _remove_callback() -> None:
    """Take the callback `install()` added out of `DEFAULT_CALLBACKS` (nothing when it added none)."""
    if _state["callback"] is not None:
        defaults, cb = _state["callback"]
        while cb in defaults:
            defaults.remove(cb)
        _state["callback"] = None


def installed_settings() -> dict[str, Any]:
    """What `install()` was given (the mode and the budget), for `GCSettings.resolve`; empty when not installed."""
    return {"mode": _state["mode"], "memory_budget": _state["budget"]} if is_installed() else {}


def is_installed() -> bool:
    """Whether the `__post_init__` patch is in place."""
    return _state["original"] is not None


@contextlib.contextmanager
def installed(mode: str | None = None, callback: bool = True, memory_budget: str | int | None = None) -> Iterator[None]:
    """`install()` for the duration of a `with` block (tests, notebooks); restores the previous state."""
    was, old_mode, old_callback, old_budget = is_installed(), _state["mode"], _state["callback"], _state["budget"]
    install(mode, callback=callback, memory_budget=memory_budget)
    try:
        yield
    finally:
        if not was:
            uninstall()
        else:
            _state["mode"], _state["budget"] = old_mode, old_budget
            if old_callback is None and _state["callback"] is not None:
                _remove_callback()
                from .model_route import unpatch_enable

                unpatch_enable()
