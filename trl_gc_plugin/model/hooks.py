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
_pre_kw: dict[int, dict[int, tuple[weakref.ref[Any], Callable[..., Any]]]] = {}
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
    if _deferred:
        _sync()
    _dispatch(_pre, module, args)


def _post_hook(module: Any, args: Any, output: Any) -> None:
    if _deferred:
        _sync()
    _dispatch(_post, module, args, output)


def _pre_kw_hook(module: Any, args: Any, kwargs: Any = None) -> None:
    if _deferred:
        _sync()
    if kwargs is not None:  # called with the keywords only for the modules flagged in `_flag`
        _dispatch(_pre_kw, module, args, kwargs)


_deferred: list[bool] = []
"""A removal put off: torch was running the `always_call` post-hooks of a forward that raised, iterating its
process-wide hook dictionary itself (a removal then is `RuntimeError: OrderedDict mutated during iteration`, which
would hide the user's exception). The next call of any of the plugin's process-wide hooks (torch iterates a copy on a
normal call) or the next registration removes what is no longer needed."""


def _sync() -> None:
    """Register the process-wide hooks while a callback waits, remove them when none does (later when torch is
    handling an exception raised in a forward, see `_deferred`)."""
    import sys

    from torch.nn.modules import module as torch_module

    unwinding = sys.exc_info()[0] is not None
    _deferred.clear()
    for name, table in (("pre", _pre), ("post", _post), ("pre_kw", _pre_kw)):
        handle = _global.get(name)
        if table and handle is None:
            if name == "pre":
                _global[name] = torch_module.register_module_forward_pre_hook(_pre_hook)
            elif name == "pre_kw":
                _global[name] = torch_module.register_module_forward_pre_hook(_pre_kw_hook)
            else:
                try:
                    _global[name] = torch_module.register_module_forward_hook(_post_hook, always_call=True)
                except TypeError:  # a torch without always_call for process-wide hooks
                    _global[name] = torch_module.register_module_forward_hook(_post_hook)
        elif not table and handle is not None:
            if unwinding:
                _deferred[:] = [True]
                continue
            handle.remove()
            del _global[name]


def _flag(module: Any, on: bool) -> None:
    """torch calls a process-wide pre-hook with the keywords for a module whose `_forward_pre_hooks_with_kwargs` holds
    the hook's id (the same test `nn.Module._call_impl` applies to its own hooks); only an int key, never a plugin
    object, and taken out again."""
    handle = _global.get("pre_kw")
    flags = getattr(module, "_forward_pre_hooks_with_kwargs", None)
    if handle is None or flags is None:
        return
    if on:
        flags[handle.id] = True
    else:
        flags.pop(handle.id, None)


_KWARGS_CAPABLE: list[bool] = []


def kwargs_capable() -> bool:
    """Whether the installed torch passes the keywords to a flagged process-wide pre-hook (tried once, on a
    throw-away module)."""
    if not _KWARGS_CAPABLE:
        import torch
        from torch.nn.modules import module as torch_module

        seen: list[Any] = []
        probe = torch.nn.Identity()
        handle = torch_module.register_module_forward_pre_hook(
            lambda m, a, k=None: seen.append(k) if m is probe else None
        )
        try:
            getattr(probe, "_forward_pre_hooks_with_kwargs", {})[handle.id] = True
            probe(torch.zeros(1))
        except Exception:
            seen.clear()
        finally:
            handle.remove()
        _KWARGS_CAPABLE.append(seen == [{}])
    return _KWARGS_CAPABLE[0]


def _add(table: dict[int, dict[int, Any]], module: Any, callback: Callable[..., Any]) -> Handle:
    _next[0] += 1
    table.setdefault(id(module), {})[_next[0]] = (weakref.ref(module), callback)
    _sync()
    return Handle(table, id(module), _next[0])


def on_forward_pre(module: Any, callback: Callable[[Any, Any], None]) -> Handle:
    """`callback(module, args)` before every forward of `module` (positional arguments only) until removed."""
    return _add(_pre, module, callback)


def on_forward_pre_with_kwargs(module: Any, callback: Callable[[Any, Any, Any], None]) -> Handle | None:
    """`callback(module, args, kwargs)` before every forward of `module` until removed; None where the installed torch
    cannot pass the keywords to a process-wide hook (`kwargs_capable`)."""
    if not kwargs_capable():
        return None
    handle = _add(_pre_kw, module, callback)
    _flag(module, True)
    return _KwHandle(handle, weakref.ref(module))


class _KwHandle:
    """Removes a keyword pre-hook and its flag on the module (idempotent)."""

    __slots__ = ("_handle", "_module")

    def __init__(self, handle: Handle, module: weakref.ref[Any]) -> None:
        self._handle, self._module = handle, module

    def remove(self) -> None:
        module = self._module()
        if module is not None and len(_pre_kw.get(id(module), {})) <= 1:  # its last keyword callback goes
            _flag(module, False)
        self._handle.remove()


def on_forward(module: Any, callback: Callable[[Any, Any, Any], None]) -> Handle:
    """`callback(module, args, output)` after every forward of `module`, also one that raised, until removed."""
    return _add(_post, module, callback)


def waiting() -> int:
    """How many callbacks wait (for tests)."""
    return sum(len(v) for table in (_pre, _post, _pre_kw) for v in table.values())
