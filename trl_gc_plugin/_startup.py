"""Start-up hook for `TRL_GC_PLUGIN`: stdlib only, never raises, runs once per process; importing it runs it.

`trl_gc_plugin.pth` imports it only when the variable is set (its line costs every interpreter start-up:
`benchmarks/pth_cost.py`); on Python 3.15+ `trl_gc_plugin.start` (PEP 829) names `run`. On: a finder patches
`transformers.training_args`, `.trainer` and `.modeling_utils` right after each is imported (at once if already).
Off: nothing. Anything else: one warning at the first of those imports, on rank 0 only, and not again in the
processes it starts (`_TRL_GC_PLUGIN_WARNED`). No module named by an environment value is ever imported.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not `from typing import ...`: typing costs milliseconds at interpreter start-up
if TYPE_CHECKING:
    from collections.abc import Callable

    _Action = Callable[[str, object], None]

ENABLE_ENV = "TRL_GC_PLUGIN"
WARNED_ENV = "_TRL_GC_PLUGIN_WARNED"  # private: set by the process that warned, inherited by its children
TARGETS = ("transformers.training_args", "transformers.trainer", "transformers.modeling_utils")
__all__ = ["ENABLE_ENV", "enabled", "run"]


def enabled(value: str | None) -> bool | None:
    """True for 1/true/yes/on/t/y, False for unset/empty/0/false/no/off/f/n (any case), None for anything else."""
    if value is None or not value.strip():
        return False
    # here, not at the top: Python 3.15's `.start` imports this module every start-up
    from ._base.flags import parse_flag

    return parse_flag(value)


_ran = False
_warned = False


def run() -> None:
    """Entry point of the `.pth` line and the `.start` file; once per process (site-packages can be scanned twice,
    e.g. through a `lib64 -> lib` symlink)."""
    global _ran
    if _ran:
        return
    _ran = True
    try:
        value = os.environ.get(ENABLE_ENV)
        state = enabled(value)
        if state is True:
            _arm(_patch)
        elif state is None and os.environ.get(WARNED_ENV) != value:
            from ._base.flags import launcher_main_process  # imported already (`enabled` read the value)

            if launcher_main_process():
                _arm(_warn)
    except Exception as exc:  # never break interpreter start-up
        _write(f"trl_gc_plugin: start-up hook not installed: {exc!r}\n")


def _write(text: str) -> None:
    try:
        sys.stderr.write(text)
    except Exception:  # no stderr (pythonw), or a closed one
        return


def _warn(fullname: str, module: object) -> None:
    """Instead of `_patch` for a value neither on nor off: once per process and its children (`WARNED_ENV`)."""
    global _warned
    if _warned:
        return
    _warned = True
    value = os.environ.get(ENABLE_ENV)
    _write(
        f"trl_gc_plugin: ignoring {ENABLE_ENV}={value!r}: use 1/true/yes/on to enable, or 0/false/no/off "
        "(or unset) to disable. Nothing was patched.\n"
    )
    try:
        os.environ[WARNED_ENV] = value or ""
    except Exception:  # e.g. putenv refused: the children warn again, which is all it costs
        return


class _TransformersFinder:
    """A meta-path finder that wraps the target modules' `exec_module`: once one has executed, `action` runs."""

    def __init__(self, action: _Action) -> None:
        self.action = action
        self.pending = {name for name in TARGETS if name not in sys.modules}

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in self.pending:
            return None
        finders = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
        spec = next((s for f in finders if (s := f.find_spec(fullname, path, target)) is not None), None)
        if spec is None:
            return None
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_patch(module: object) -> None:
            exec_module(module)
            vars(loader).pop("exec_module", None)  # drop the instance attribute below: the class method is back
            self.loaded(fullname, module)

        loader.exec_module = exec_then_patch  # type: ignore[union-attr]
        return spec

    def loaded(self, fullname: str, module: object) -> None:
        self.pending.discard(fullname)
        if self.action is _warn:
            self.pending.clear()
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        self.action(fullname, module)


def _patch(fullname: str, module: object) -> None:
    try:
        from .routes import model_route, post_init

        if fullname == "transformers.training_args":
            post_init.patch_training_args(module.TrainingArguments)  # type: ignore[attr-defined]
            post_init.install_refusal_hook()  # a launcher's refusal reads as the message, not a traceback
        elif fullname == "transformers.trainer":
            post_init.register_callback(module)
        elif fullname == "transformers.modeling_utils":
            model_route.patch_enable(module.PreTrainedModel)  # type: ignore[attr-defined]  # loops without a Trainer
    except Exception:
        import logging

        logging.getLogger("trl_gc_plugin").warning(
            "TRL_GC_PLUGIN: could not patch %s; training goes on without the plugin.", fullname, exc_info=True
        )


def _arm(action: _Action) -> None:
    finder = _TransformersFinder(action)
    for name in TARGETS:
        if name in sys.modules:
            action(name, sys.modules[name])
            if action is _warn:
                return
    if finder.pending and not any(isinstance(f, _TransformersFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, finder)


run()  # the `.pth` line imports this module only when the variable is set; a second call does nothing
