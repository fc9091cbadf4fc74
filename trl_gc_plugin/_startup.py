"""Start-up hook for `TRL_GC_PLUGIN`: stdlib only, never raises, runs once per process; importing it runs it.

`trl_gc_plugin.pth` imports this module only when the variable is set: its line tests `"TRL_GC_PLUGIN" in
os.environ` and nothing else, because what a `.pth` line costs every interpreter start-up is parsing and compiling
it, token by token (`benchmarks/pth_cost.py`). Every other decision is taken here. On Python 3.15+, `trl_gc_plugin.start` (PEP 829)
names `run`, and its presence disables the `.pth` import line.

- unset, empty, `0`/`false`/`no`/`off` (any case): returns; nothing is patched.
- `1`/`true`/`yes`/`on`: puts a finder on `sys.meta_path` that waits for `transformers.training_args`,
  `transformers.trainer` and `transformers.modeling_utils` (the enable methods, for loops without a Trainer) to be
  imported, patches each right after it has executed, and removes itself once all are done. What is already imported is patched at once. Neither torch nor transformers is imported here.
- anything else: the same finder, but the first of those imports writes one warning on stderr instead of patching,
  so processes that never import transformers' training code (pip, unrelated scripts) stay silent. The process
  that warns sets `_TRL_GC_PLUGIN_WARNED` to the value; the processes it starts inherit it (`trl sft` ->
  `accelerate launch` -> the training process) and stay silent for that same value. Ranks other than 0 of a
  distributed launch (`RANK`, else `LOCAL_RANK`) stay silent too, as the plugin's own logs do: one warning per
  launch.

The variable is only a flag: no module named by an environment value is ever imported.
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
    from ._base.flags import (
        parse_flag,
    )  # here, not at the top: Python 3.15's `.start` imports this module every start-up

    return parse_flag(value)


_ran = False
_warned = False


def run() -> None:
    """Entry point of the `.pth` line (by importing this module) and of the `.start` file; runs once per process
    (site-packages can be scanned twice, e.g. through a `lib64 -> lib` symlink in a venv)."""
    global _ran
    if _ran:
        return
    _ran = True
    try:
        value = os.environ.get(ENABLE_ENV)
        state = enabled(value)
        if state is True:
            _arm(_patch)
        elif state is None and os.environ.get(WARNED_ENV) != value and _main_process():
            _arm(_warn)
    except Exception as exc:  # never break interpreter start-up
        _write(f"trl_gc_plugin: start-up hook not installed: {exc!r}\n")


def _main_process() -> bool:
    from ._base.flags import launcher_main_process  # imported already (`enabled` read the value)

    return launcher_main_process()


def _write(text: str) -> None:
    try:
        sys.stderr.write(text)
    except Exception:  # no stderr (pythonw), or a closed one
        return


def _warn(fullname: str, module: object) -> None:
    """Called instead of `_patch` for a value that is neither on nor off: once per process, and not again in the
    processes this one starts (they inherit `WARNED_ENV`)."""
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
    """A meta-path finder that lets the real finders find the target modules and wraps their `exec_module`: once a
    target has executed, `action(fullname, module)` runs (`_patch`, or `_warn`, which needs only the first)."""

    def __init__(self, action: _Action) -> None:
        self.action = action
        self.pending = {name for name in TARGETS if name not in sys.modules}

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
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
        from .routes import post_init as patching

        if fullname == "transformers.training_args":
            patching.patch_training_args(module.TrainingArguments)  # type: ignore[attr-defined]
            patching.install_refusal_hook()  # a launcher's refusal reads as the message, not a traceback
        elif fullname == "transformers.trainer":
            patching.register_callback(module)
        elif fullname == "transformers.modeling_utils":
            from .routes import model_route as loop

            loop.patch_enable(module.PreTrainedModel)  # type: ignore[attr-defined]  # loops without a Trainer
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
