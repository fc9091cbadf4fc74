"""trl-gc-plugin: safe gradient (activation) checkpointing for transformers and TRL.

Importing this package patches nothing and imports nothing heavy: every public name is loaded on first use
(PEP 562), so the start-up hook (`_startup.py`) can live inside the package at no cost. Use `SafeGCCallback`
explicitly, call `install()` (undo with `uninstall()`), or set `TRL_GC_PLUGIN=1`; in a loop without a Trainer, call
`guard(model)` after `gradient_checkpointing_enable` (or let `install()` / `TRL_GC_PLUGIN=1` do it).
"""

from __future__ import annotations

TYPE_CHECKING = False  # not `from typing import ...`: typing costs milliseconds at interpreter start-up

__version__ = "0.1.0"

__all__ = [
    "RULES",
    "Decision",
    "Facts",
    "GCConfigError",
    "Rule",
    "SafeGCCallback",
    "__version__",
    "decide",
    "guard",
    "install",
    "installed",
    "is_installed",
    "uninstall",
]

if TYPE_CHECKING:
    from .callback import SafeGCCallback
    from .decisions import Decision
    from .engine import decide
    from .errors import GCConfigError
    from .facts import Facts
    from .loop import guard
    from .patching import install, installed, is_installed, uninstall
    from .rules import RULES, Rule

_LAZY = {
    "RULES": "rules",
    "Rule": "rules",
    "Decision": "decisions",
    "Facts": "facts",
    "GCConfigError": "errors",
    "decide": "engine",
    "SafeGCCallback": "callback",  # imports transformers
    "guard": "loop",  # loops without a Trainer
    "install": "patching",
    "installed": "patching",
    "is_installed": "patching",
    "uninstall": "patching",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
