"""Start-up hook for `TRL_GC_PLUGIN=1`: stdlib only, never raises.

Run at interpreter start-up by `trl_gc_plugin.pth` (only when the variable is set: the `.pth` line is one
`os.environ` lookup) and, on Python 3.15+, by `trl_gc_plugin.start` (PEP 829), whose presence disables the `.pth`
import line. It imports neither torch nor transformers: it puts a finder on `sys.meta_path` that waits for
`transformers.training_args` and `transformers.trainer` to be imported, patches each right after it has executed,
and removes itself once both are done. If transformers is already imported, it patches at once.

The variable is only a flag: no module named by an environment value is ever imported.
"""

from __future__ import annotations

import os
import sys

from ._flags import OFF, ON, parse_flag

ENABLE_ENV = "TRL_GC_PLUGIN"
TARGETS = ("transformers.training_args", "transformers.trainer")
__all__ = ["OFF", "ON", "enabled", "run"]


def enabled(value: str | None) -> bool | None:
    """True for 1/true/yes/on, False for unset/empty/0/false/no/off (any case), None for anything else."""
    return False if value is None else parse_flag(value)


_ran = False


def run() -> None:
    """Entry point of the `.pth` line and the `.start` file; runs once per process (site-packages can be scanned
    twice, e.g. through a `lib64 -> lib` symlink in a venv)."""
    global _ran
    if _ran:
        return
    _ran = True
    value = os.environ.get(ENABLE_ENV)
    state = enabled(value)
    if state is False:
        return
    if state is None:
        sys.stderr.write(
            f"trl_gc_plugin: ignoring {ENABLE_ENV}={value!r}: use 1/true/yes/on to enable, or 0/false/no/off "
            "(or unset) to disable. Nothing was patched.\n"
        )
        return
    try:
        _arm()
    except Exception as exc:  # never break interpreter start-up
        sys.stderr.write(f"trl_gc_plugin: start-up hook not installed: {exc!r}\n")


class _TransformersFinder:
    """A meta-path finder that lets the real finders find the target modules and wraps their `exec_module`."""

    def __init__(self) -> None:
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
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)
        _patch(fullname, module)


def _patch(fullname: str, module: object) -> None:
    try:
        from . import patching

        if fullname == "transformers.training_args":
            patching.patch_training_args(module.TrainingArguments)  # type: ignore[attr-defined]
        elif fullname == "transformers.trainer":
            patching.register_callback(module)
    except Exception:
        import logging

        logging.getLogger("trl_gc_plugin").warning(
            "TRL_GC_PLUGIN: could not patch %s; training goes on without the plugin.", fullname, exc_info=True
        )


def _arm() -> None:
    finder = _TransformersFinder()
    for name in TARGETS:
        if name in sys.modules:
            _patch(name, sys.modules[name])
    if finder.pending and not any(isinstance(f, _TransformersFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, finder)
