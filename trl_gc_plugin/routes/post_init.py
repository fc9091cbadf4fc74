"""`install()` and the post-init route, all reversible: `TrainingArguments.__post_init__` (every TRL config runs it,
so the safe `use_reentrant` is in the arguments from construction), the callback in `DEFAULT_CALLBACKS` (every
Trainer starts from it), and the enable methods (`model_route`). Importing `trl_gc_plugin` does none of this.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from .._base import report
from .._base.flags import parse_flag
from ..core.errors import GCConfigError, contained
from ..core.modes import Mode
from ..core.settings import BOOL_FORMS, BY_NAME, INSTALLED, GCSettings, parse_bool
from ..model import hooks, probe
from ..runtime import hosts
from ..runtime.run import Run
from . import model_route

_MARK = "__trl_gc_plugin_wrapper__"
_lock = threading.RLock()
_state: dict[str, Any] = {"original": None, "callback": None}  # what the patches replaced


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


def post_init_decide(args: Any, user_given: bool, user_value: Any) -> None:
    """After the original `__post_init__`: a `Run` on the arguments alone decides; its decisions stay in the
    arguments' record (outside the object) for the callback to carry on from."""
    # `install()`'s settings, else the variables: a strict refusal of a bad value refuses the arguments
    settings = GCSettings.resolve({}, caller="TRL_GC_PLUGIN=1")
    record = probe.start_record(args, user_given, user_value)
    if not probe.facts_from_args(args, stage="post_init").gc_enabled:
        return
    with contained("the launcher's adaptation"):
        hosts.adopt(args)  # inside Axolotl without its plugin line: its logging, the value it wrote
    report.follow_trainer(args)
    # the distributed state is not read here (`args.process_index` would set it up): the launcher's rank decides
    run = Run(settings, main_process=report.is_main_process(), write_json=False)
    record.decisions.extend(run.decide(args, None, stage="post_init"))


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def __post_init__(self: Any, *a: Any, **kw: Any) -> Any:
        user_given, user_value = _user_use_reentrant(self)
        result = original(self, *a, **kw)
        if is_installed():  # uninstalled while an old reference was still around: behave as the original
            post_init_decide(self, user_given, user_value)
        return result

    setattr(__post_init__, _MARK, True)
    return __post_init__


def patch_training_args(cls: Any, mode: Mode | None = None) -> None:
    """Wrap `cls.__post_init__` (idempotent). Without a mode (`TRL_GC_PLUGIN=1`) a bad `TRL_GC_PLUGIN_MODE` is said
    now, once."""
    if mode is None:
        env = BY_NAME["mode"].env
        GCSettings.resolve({}, installed={}, environ={env: os.environ.get(env, "")}, caller="TRL_GC_PLUGIN=1")
    with _lock:
        current = cls.__dict__["__post_init__"]
        if not getattr(current, _MARK, False):
            _state["original"] = (cls, current)
            cls.__post_init__ = _wrap(current)


TRACEBACK_ENV = "TRL_GC_PLUGIN_TRACEBACK"


def install_refusal_hook() -> None:
    """For `TRL_GC_PLUGIN=1` launchers: an uncaught `GCConfigError` prints its message, not a traceback through the
    launcher's argument parsing (unless `TRL_GC_PLUGIN_TRACEBACK=1`). Undone by `uninstall()`."""
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
    """Patch `TrainingArguments.__post_init__` and register `SafeGCCallback` for every Trainer (and, with `callback`,
    the enable methods for loops without one). Idempotent: a second call only updates the mode. Undo with
    `uninstall()`. `mode` defaults to `TRL_GC_PLUGIN_MODE`, then strict; `memory_budget` as `SafeGCCallback`'s.
    """
    from transformers import TrainingArguments

    try:
        callback = parse_bool(callback)
    except ValueError:
        raise GCConfigError(f"install(callback=...): got {callback!r}; callback accepts {BOOL_FORMS}") from None
    resolved = GCSettings.resolve({"mode": mode, "memory_budget": memory_budget}, installed={}, caller="install")
    with _lock:
        INSTALLED["mode"] = resolved.mode
        if memory_budget is not None:
            INSTALLED["memory_budget"] = resolved.memory_budget
        patch_training_args(TrainingArguments, resolved.mode)
    if callback:
        register_callback()
        model_route.patch_enable()  # loops without a Trainer


def uninstall() -> None:
    """Undo `install()` (or the `TRL_GC_PLUGIN` start-up hook) and remove every hook a run still holds."""
    with _lock:
        if _state["original"] is not None:
            cls, original = _state["original"]
            if getattr(cls.__dict__.get("__post_init__"), _MARK, False):
                cls.__post_init__ = original
            else:
                report.logger.warning("TrainingArguments.__post_init__ was re-patched by someone else; left as it is.")
        _remove_callback()
        _remove_refusal_hook()
        _state["original"] = None
        INSTALLED.clear()
    model_route.unpatch_enable()
    hooks.remove_all()


def _remove_callback() -> None:
    if _state["callback"] is not None:
        defaults, cb = _state["callback"]
        while cb in defaults:
            defaults.remove(cb)
        _state["callback"] = None


def is_installed() -> bool:
    return _state["original"] is not None


@contextlib.contextmanager
def installed(mode: str | None = None, callback: bool = True, memory_budget: str | int | None = None) -> Iterator[None]:
    """`install()` for the duration of a `with` block; restores the previous state."""
    was, old_settings, old_callback = is_installed(), dict(INSTALLED), _state["callback"]
    install(mode, callback=callback, memory_budget=memory_budget)
    try:
        yield
    finally:
        if not was:
            uninstall()
        else:
            INSTALLED.clear()
            INSTALLED.update(old_settings)
            if old_callback is None and _state["callback"] is not None:
                _remove_callback()
                model_route.unpatch_enable()
