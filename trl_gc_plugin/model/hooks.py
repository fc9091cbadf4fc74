"""Every hook the plugin adds, and the one registry per run (`Hooks`) whose `remove()` takes all of it away.

Nothing of the plugin is ever in a model's own hook tables or `__dict__`, so a deep copy or a pickle of the model
carries nothing of it: process-wide module forward hooks and class methods dispatch by identity to what is registered
for one instance, and exist only while something is. A removal torch does not allow at that moment (it is iterating
those hooks: an optimizer step's pre-hooks, the post-hooks of a forward that raised) is done at the next call of any
of the plugin's hooks, the next registration, or the end of the process.
"""

from __future__ import annotations

import atexit
import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from .._base import report

Entry = tuple[weakref.ref[Any], Callable[..., Any]]
Table = dict[int, dict[int, Entry]]
_pre: Table = {}
_pre_kw: Table = {}
_post: Table = {}
_global: dict[str, Any] = {}
_next = [0]
_deferred: list[Callable[[], None]] = []  # removals put off while torch iterates the hooks they would remove
_stepping: list[bool] = []  # non-empty while a plugin callback runs inside torch's optimizer pre-hook loop


class Handle:
    """Removes one hook (idempotent). `lasting`: it stays through `Hooks.remove(keep_lasting=True)`; `repair`: it
    undoes a repair of the model, which `Hooks.remove(keep_repairs=True)` leaves in place."""

    __slots__ = ("_remove", "lasting", "repair")

    def __init__(self, remove: Callable[[], Any], lasting: bool = False, repair: bool = False) -> None:
        self._remove: Callable[[], Any] | None = remove
        self.lasting = lasting or repair
        self.repair = repair

    def remove(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()


def flush() -> None:
    """Carry out the removals put off, now that torch is not iterating the plugin's hooks."""
    if _stepping or sys.exc_info()[0] is not None:
        return
    pending, _deferred[:] = list(_deferred), []
    for removal in pending:
        removal()
    _sync()


def _dispatch(table: Table, module: Any, *rest: Any) -> None:
    if _deferred:
        flush()
    entries = table.get(id(module))
    if not entries:
        return
    for ref, callback in list(entries.values()):
        if ref() is module:
            callback(module, *rest)


def _pre_kw_hook(module: Any, args: Any, kwargs: Any = None) -> None:
    if kwargs is not None:  # called with the keywords only for the modules flagged in `_flag`
        _dispatch(_pre_kw, module, args, kwargs)


_HOOKS: dict[str, tuple[Table, Callable[..., None]]] = {
    "pre": (_pre, functools.partial(_dispatch, _pre)),
    "post": (_post, functools.partial(_dispatch, _post)),
    "pre_kw": (_pre_kw, _pre_kw_hook),
}


def _sync() -> None:
    """Register the process-wide module hooks while a callback waits, remove them when none does (later when torch
    is handling an exception raised in a forward: it is iterating its process-wide post-hooks itself)."""
    if "torch.nn.modules.module" not in sys.modules:  # torch never imported: nothing registered (nor to import at exit)
        return
    from torch.nn.modules import module as torch_module

    for name, (table, hook) in _HOOKS.items():
        handle = _global.get(name)
        if table and handle is None and name == "post":
            _global[name] = torch_module.register_module_forward_hook(hook, always_call=True)
        elif table and handle is None:
            _global[name] = torch_module.register_module_forward_pre_hook(hook)
        elif not table and handle is not None:
            if sys.exc_info()[0] is not None:
                if _sync not in _deferred:
                    _deferred.append(_sync)
                continue
            handle.remove()
            del _global[name]


def _add(table: Table, module: Any, callback: Callable[..., Any]) -> Handle:
    if _deferred:
        flush()
    _next[0] += 1
    key, at = _next[0], id(module)
    table.setdefault(at, {})[key] = (weakref.ref(module), callback)
    _sync()

    def remove() -> None:
        entries = table.get(at)
        if entries is not None:
            entries.pop(key, None)
            if not entries:
                del table[at]
        _sync()

    return Handle(remove)


def _flag(module: Any, on: bool) -> None:
    """torch calls a process-wide pre-hook with the keywords for a module whose `_forward_pre_hooks_with_kwargs` holds
    the hook's id (the same test `nn.Module._call_impl` applies to its own hooks); only an int key, never a plugin
    object, and taken out again."""
    handle = _global.get("pre_kw")
    flags = getattr(module, "_forward_pre_hooks_with_kwargs", None)
    if handle is not None and flags is not None:
        if on:
            flags[handle.id] = True
        else:
            flags.pop(handle.id, None)


@functools.lru_cache(maxsize=1)
def kwargs_capable() -> bool:
    """Whether the installed torch passes the keywords to a flagged process-wide pre-hook (tried on a throw-away)."""
    import torch
    from torch.nn.modules import module as torch_module

    seen: list[Any] = []
    probe = torch.nn.Identity()
    handle = torch_module.register_module_forward_pre_hook(lambda m, a, k=None: seen.append(k) if m is probe else None)
    try:
        getattr(probe, "_forward_pre_hooks_with_kwargs", {})[handle.id] = True
        probe(torch.zeros(1))
    except Exception:
        seen.clear()
    finally:
        handle.remove()
    return seen == [{}]


_MISSING = object()
_METHODS: dict[tuple[type, str], _Method] = {}


class _Method:
    """`cls.<name>` dispatching by identity while some instance is registered."""

    def __init__(self, cls: type, name: str) -> None:
        self.cls, self.name = cls, name
        self.held = cls.__dict__.get(name, _MISSING)
        real = getattr(cls, name)
        table: dict[int, Entry] = {}
        self.table = table

        @functools.wraps(real)
        def method(instance: Any, *args: Any, **kwargs: Any) -> Any:
            if _deferred:
                flush()
            entry = table.get(id(instance))
            if entry is None or entry[0]() is not instance:
                return real(instance, *args, **kwargs)
            return entry[1](functools.partial(real, instance), *args, **kwargs)

        self.method = method
        setattr(cls, name, method)

    def drop(self, key: int, ref: Any = None) -> None:
        """Forget the instance registered under `key` (only the one `ref` refers to, when given: an `id` is reused
        once its object is collected); the class gets its method back with the last one."""
        entry = self.table.get(key)
        if entry is not None and (ref is None or entry[0] is ref):
            del self.table[key]
        if self.table:
            return
        _METHODS.pop((self.cls, self.name), None)
        if self.cls.__dict__.get(self.name) is self.method:  # else someone patched it after us: leave theirs
            if self.held is _MISSING:
                delattr(self.cls, self.name)
            else:
                setattr(self.cls, self.name, self.held)
        if _deferred:  # the last instance went (collected, or its run is over): what was put off goes too
            flush()


def patched_classes() -> list[str]:
    """`Class.method` of every class method the plugin dispatches now (for tests)."""
    return sorted(f"{cls.__name__}.{name}" for cls, name in _METHODS)


class Hooks:
    """One run's hooks: every registration goes through it, `remove()` takes all of it away (the last added first)."""

    def __init__(self) -> None:
        self._items: list[Any] = []

    def add(self, handle: Any) -> Any:
        """Keep `handle` (anything with `remove()`) until `remove()`; returns it."""
        self._items.append(handle)
        _LIVE.add(self)
        return handle

    def forward_pre(self, module: Any, callback: Callable[[Any, Any], None]) -> Handle:
        """`callback(module, args)` before every forward of `module` (positional arguments only)."""
        return self.add(_add(_pre, module, callback))

    def forward_pre_with_kwargs(self, module: Any, callback: Callable[[Any, Any, Any], None]) -> Handle | None:
        """`callback(module, args, kwargs)` before each forward of `module`; None if torch cannot (`kwargs_capable`)."""
        if not kwargs_capable():
            return None
        handle, ref = _add(_pre_kw, module, callback), weakref.ref(module)
        _flag(module, True)

        def remove() -> None:
            if (alive := ref()) is not None and len(_pre_kw.get(id(alive), {})) <= 1:  # its last keyword callback
                _flag(alive, False)
            handle.remove()

        return self.add(Handle(remove))

    def forward(self, module: Any, callback: Callable[[Any, Any, Any], None]) -> Handle:
        """`callback(module, args, output)` after every forward of `module`, also one that raised."""
        return self.add(_add(_post, module, callback))

    def method(self, instance: Any, name: str, replacement: Callable[..., Any], lasting: bool = False) -> Handle:
        """Make `instance.<name>(*args, **kwargs)` call `replacement(original, *args, **kwargs)` (`original`: the real
        method bound to `instance`), through its class, until removed (or `instance` is collected)."""
        if _deferred:
            flush()
        method = _METHODS.get((type(instance), name))
        if method is None:
            method = _METHODS[(type(instance), name)] = _Method(type(instance), name)
        key = id(instance)
        method.table[key] = (weakref.ref(instance, lambda dead: method.drop(key, dead)), replacement)
        return self.add(Handle(functools.partial(method.drop, key), lasting))

    def optimizer_step(self, callback: Callable[[Any], None]) -> Handle:
        """`callback(optimizer)` before every step of every torch optimizer (accelerate's and DeepSpeed's wrap one).
        Once removed it does nothing; torch lets it go at once, or, from inside its own loop over the pre-hooks, at
        the next moment it can (`flush`)."""
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        if _deferred:
            flush()
        state = {"removed": False}

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            if state["removed"]:
                return
            _stepping.append(True)
            try:
                callback(optimizer)
            finally:
                _stepping.pop()

        torch_handle = register_optimizer_step_pre_hook(pre)

        def remove() -> None:
            state["removed"] = True
            if _stepping:
                _deferred.append(torch_handle.remove)
            else:
                torch_handle.remove()

        return self.add(Handle(remove))

    def undo(self, action: Callable[[], Any], repair: bool = False) -> Handle:
        """Run `action` when the run's hooks go; `repair`: it takes back a repair of the model (see `remove`)."""
        return self.add(Handle(action, repair=repair))

    def discard(self, handle: Any) -> None:
        """Remove one handle now (a check whose part of the first step is over)."""
        if handle in self._items:
            self._items.remove(handle)
        handle.remove()

    def remove(self, keep_lasting: bool = False, keep_repairs: bool = False) -> None:
        """Remove every hook of the run, the last added first, each whatever the others do. `keep_lasting`: the lasting
        ones stay (a loop's first step is over); `keep_repairs`: the repairs stay on the model, forgotten."""
        kept = [h for h in self._items if keep_lasting and getattr(h, "lasting", False)]
        gone = [h for h in self._items if h not in kept and not (keep_repairs and getattr(h, "repair", False))]
        self._items = kept
        for handle in reversed(gone):
            try:
                handle.remove()
            except Exception as exc:  # a plugin bug never stops training
                report.note(f"could not remove a hook of the plugin ({type(exc).__name__}: {exc})", "warning")
        if not self._items:
            _LIVE.discard(self)

    def __len__(self) -> int:
        return len(self._items)


_LIVE: weakref.WeakSet[Hooks] = weakref.WeakSet()


def remove_all() -> None:
    """Every run's hooks, removed (`uninstall()`, the end of the process)."""
    for hooks in list(_LIVE):
        hooks.remove()
    flush()


def waiting() -> int:
    """How many module callbacks wait (for tests: each keeps the process-wide hooks registered)."""
    return sum(len(v) for table in (_pre, _post, _pre_kw) for v in table.values())


atexit.register(remove_all)
