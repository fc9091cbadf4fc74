"""trl-gc-plugin: safe gradient (activation) checkpointing for transformers and TRL.

Importing this package patches nothing and loads every public name on first use (PEP 562), so the start-up hook can
live inside it at no cost. Use `SafeGCCallback`, `install()` / `TRL_GC_PLUGIN=1`, or `guard(model)` in a loop.
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
    from .core.decisions import Decision
    from .core.engine import decide
    from .core.errors import GCConfigError
    from .core.facts import Facts
    from .core.rules import RULES, Rule
    from .routes.callback import SafeGCCallback
    from .routes.model_route import guard
    from .routes.post_init import install, installed, is_installed, uninstall

_LAZY = {
    "RULES": "core.rules",
    "Rule": "core.rules",
    "Decision": "core.decisions",
    "Facts": "core.facts",
    "GCConfigError": "core.errors",
    "decide": "core.engine",
    "SafeGCCallback": "routes.callback",  # imports transformers
    "guard": "routes.model_route",  # loops without a Trainer
    "install": "routes.post_init",
    "installed": "routes.post_init",
    "is_installed": "routes.post_init",
    "uninstall": "routes.post_init",
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
