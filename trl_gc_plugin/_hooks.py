"""Forward hooks on chosen modules that live outside the modules.

The plugin watches a model's first training step (the first forward of each checkpointing stack, the first batch
for the parity probe, a second forward before the first backward). Hooks registered on the modules would sit in the
modules' own hook dictionaries, so a copy of the model made meanwhile (an EMA or reference model deep-copied in a
user's `on_train_begin`, a `pickle` of the whole model) would carry them for good. Here one process-wide pre-hook and
one process-wide post-hook (`torch.nn.modules.module.register_module_forward_*_hook`) dispatch to the callbacks
registered for a module by identity; they exist only while some callback waits, so the steady-state cost is zero and
nothing of the plugin is ever in a module's `__dict__`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

_pre: dict[int, dict[int, tuple[weakref.ref[Any], Callable[..., Any]]]] = {}
_post: dict[int, dict[int, tuple[weakref.ref[Any], Callable[..., Any]]]] = {}
_global: dict[str, Any] = {}
_next = [0]


class Handle:
    """Removes one registered callback (idempotent)."""

    __slots__ = ("_key", "_module", "_table")

    def __init__(self, table: dict[int, dict[int, Any]], module: int, key: int) -> None:
        self._table, self._module, self._key = table, module, key

    def remove(self) -> None:
        entries = self._table.get(self._module)
        if entries is not None:
            entries.pop(self._key, None)
            if not entries:
                del self._table[self._module]
        _sync()


def _dispatch(table: dict[int, dict[int, Any]], module: Any, *rest: Any) -> None:
    entries = table.get(id(module))
    if not entries:
        return
    for ref, callback in list(entries.values()):
        if ref() is module:
            callback(module, *rest)


def _pre_hook(module: Any, args: Any) -> None:
    _dispatch(_pre, module, args)


def _post_hook(module: Any, args: Any, output: Any) -> None:
    _dispatch(_post, module, args, output)


def _sync() -> None:
    """Register the process-wide hooks while a callback waits, remove them when none does."""
    from torch.nn.modules import module as torch_module

    for name, table in (("pre", _pre), ("post", _post)):
        handle = _global.get(name)
        if table and handle is None:
            if name == "pre":
                _global[name] = torch_module.register_module_forward_pre_hook(_pre_hook)
            else:
                try:
                    _global[name] = torch_module.register_module_forward_hook(_post_hook, always_call=True)
                except TypeError:  # a torch without always_call for process-wide hooks
                    _global[name] = torch_module.register_module_forward_hook(_post_hook)
        elif not table and handle is not None:
            handle.remove()
            del _global[name]


def _add(table: dict[int, dict[int, Any]], module: Any, callback: Callable[..., Any]) -> Handle:
    _next[0] += 1
    table.setdefault(id(module), {})[_next[0]] = (weakref.ref(module), callback)
    _sync()
    return Handle(table, id(module), _next[0])


def on_forward_pre(module: Any, callback: Callable[[Any, Any], None]) -> Handle:
    """`callback(module, args)` before every forward of `module` (positional arguments only) until removed."""
    return _add(_pre, module, callback)


def on_forward(module: Any, callback: Callable[[Any, Any, Any], None]) -> Handle:
    """`callback(module, args, output)` after every forward of `module`, also one that raised, until removed."""
    return _add(_post, module, callback)


def waiting() -> int:
    """How many callbacks wait (for tests)."""
    return sum(len(v) for v in _pre.values()) + sum(len(v) for v in _post.values())
