"""The post-init route and `install()`: patches, all reversible: `TrainingArguments.__post_init__`, the callback in
`DEFAULT_CALLBACKS`, and (through `model_route`) the enable methods of loops without a Trainer.

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
from ..core.errors import GCConfigError, contained
from ..core.modes import Mode
from ..core.settings import BOOL_FORMS, BY_NAME, INSTALLED, GCSettings, parse_bool
from ..model import hooks, probe
from ..runtime.run import Run
from . import hosts

logger = logging.getLogger("trl_gc_plugin")

_MARK = "__trl_gc_plugin_wrapper__"
_lock = threading.RLock()
_state: dict[str, Any] = {"original": None, "callback": None}
"""What the patches replaced; what `install()` was given is `settings.INSTALLED`."""


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


def post_init_decide(args: Any, settings: GCSettings, user_given: bool, user_value: Any) -> list[Any]:
    """What the patched `__post_init__` runs once the original has: a `Run` on the arguments alone (stage
    `post_init`) decides, refuses or applies and logs, as the callback's stages do; its decisions stay in the
    arguments' record (`probe.PostInitRecord`, outside the object) for the callback to carry on from."""
    record = probe.start_record(args, user_given, user_value)
    if not probe.facts_from_args(args, stage="post_init").gc_enabled:
        return []
    with contained("the launcher's adaptation"):
        hosts.adopt(args)  # inside Axolotl without its plugin line: its logging, the value it wrote
    report.follow_trainer(args)
    # the distributed state is not read here (`args.process_index` would set it up): the launcher's rank decides
    run = Run(settings, main_process=report.is_main_process(), write_json=False)
    decisions = run.decide(args, None, stage="post_init")
    record.decisions.extend(decisions)
    return decisions


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def __post_init__(self: Any, *a: Any, **kw: Any) -> Any:
        user_given, user_value = _user_use_reentrant(self)
        result = original(self, *a, **kw)
        if is_installed():  # uninstalled while an old reference was still around: behave as the original
            post_init_decide(self, _settings(), user_given, user_value)
        return result

    setattr(__post_init__, _MARK, True)
    return __post_init__


def patch_training_args(cls: Any, mode: Mode | None = None) -> None:
    """Wrap `cls.__post_init__` (`transformers.TrainingArguments`); a second call only updates the mode. Without a
    mode (the `TRL_GC_PLUGIN=1` route, patched while transformers is imported) the variables are read when a run
    starts; a bad `TRL_GC_PLUGIN_MODE` is said now, once, by the main process, and `strict` used."""
    if mode is None:
        env = BY_NAME["mode"].env
        GCSettings.resolve({}, installed={}, environ={env: os.environ.get(env, "")}, caller="TRL_GC_PLUGIN=1")
    with _lock:
        current = cls.__dict__["__post_init__"]
        if not getattr(current, _MARK, False):
            _state["original"] = (cls, current)
            cls.__post_init__ = _wrap(current)


def _settings() -> GCSettings:
    """The settings of a run this route starts: `install()`'s, else the variables (a strict refusal of a bad value
    refuses the arguments, as the callback refuses it when the Trainer is built)."""
    return GCSettings.resolve({}, caller="TRL_GC_PLUGIN=1")


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
        from .model_route import patch_enable

        patch_enable()  # loops without a Trainer: the model route


def uninstall() -> None:
    """Undo `install()` (or the `TRL_GC_PLUGIN` start-up hook): restore the original `__post_init__`, remove the
    callback from `DEFAULT_CALLBACKS`, restore the enable methods, and remove every hook a run still holds. Safe to
    call when nothing is installed."""
    with _lock:
        if _state["original"] is not None:
            cls, original = _state["original"]
            if getattr(cls.__dict__.get("__post_init__"), _MARK, False):
                cls.__post_init__ = original
            else:
                logger.warning("TrainingArguments.__post_init__ was re-patched by someone else; left as it is.")
        _remove_callback()
        _remove_refusal_hook()
        _state["original"] = None
        INSTALLED.clear()
    from .model_route import unpatch_enable

    unpatch_enable()
    hooks.remove_all()


def _remove_callback() -> None:
    """Take the callback `install()` added out of `DEFAULT_CALLBACKS` (nothing when it added none)."""
    if _state["callback"] is not None:
        defaults, cb = _state["callback"]
        while cb in defaults:
            defaults.remove(cb)
        _state["callback"] = None


def is_installed() -> bool:
    """Whether the `__post_init__` patch is in place."""
    return _state["original"] is not None


@contextlib.contextmanager
def installed(mode: str | None = None, callback: bool = True, memory_budget: str | int | None = None) -> Iterator[None]:
    """`install()` for the duration of a `with` block (tests, notebooks); restores the previous state."""
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
                from .model_route import unpatch_enable

                unpatch_enable()
