"""trl-gc-plugin: safe gradient (activation) checkpointing for transformers and TRL.

Importing this package patches nothing. Use `SafeGCCallback` explicitly, or call `install()` (undo with
`uninstall()`), or set `TRL_GC_PLUGIN=1`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .decisions import Decision
from .engine import decide
from .errors import GCConfigError
from .facts import Facts
from .rules import RULES, Rule

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
    "install",
    "installed",
    "is_installed",
    "uninstall",
]

if TYPE_CHECKING:
    from .callback import SafeGCCallback
    from .patching import install, installed, is_installed, uninstall

_LAZY = {
    "SafeGCCallback": "callback",
    "install": "patching",
    "installed": "patching",
    "is_installed": "patching",
    "uninstall": "patching",
}


def __getattr__(name: str) -> Any:
    # transformers is only imported when these are first used, so `import trl_gc_plugin` stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
