"""Keep what was enabled: the layer pattern, the offload wrapper and the plugin's extra keywords survive re-enables.

TRL's DPO, GRPO, KTO and RLOO switch checkpointing off and back on every step with
`model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)`: the raw argument kwargs. That puts
`every_n_layers` / `offload` into the kwargs torch's checkpoint gets (every layer checkpointed again, the offload
wrapper replaced by plain `checkpoint`, and with reentrant `ValueError: Unexpected keyword arguments:
every_n_layers` in the next forward; reproduced on 5.23); a transformers before 5.16 (`every_n_layers`) or 5.17
(`offload`) does not understand them at all. `EnableGuard` stands in
for the model's `gradient_checkpointing_enable` for the duration of training: the method of the unwrapped model's
class dispatches by identity (PEFT wrappers reach it through their `__getattr__`; transformers 5's
`activation_checkpointing_enable` routes through it too), so nothing is put on the model, and a deep copy of it made
meanwhile (an EMA or reference model) enables its own checkpointing, not the original's. The guard: it hands `every_n_layers` / `offload` to transformers as arguments where it reads them (as
detected, `capabilities.py`) or takes them out, calls the real method, and then puts back the recorded per-block flags and the
checkpoint function's wrapper and extra keywords (a plan's `context_fn`), leaving `use_reentrant` to the call (the
drift check watches that one). `remove()` puts the class back once its last guard goes.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

from .._base.weak import WeakIdMap
from . import ckpt, probe

LAYER_KWARGS = ("every_n_layers", "offload")
_MARK = "__trl_gc_plugin_enable_guard__"

_GUARDS: WeakIdMap[EnableGuard] = WeakIdMap()
"""The guard of each guarded model, by identity (kept off the model: a copy or pickle of it carries nothing)."""
_PATCHED: dict[type, tuple[Any, int]] = {}
"""Model classes whose `gradient_checkpointing_enable` dispatches to a guard: (what the class itself held, users)."""
_MISSING = object()


def _patch_class(cls: type) -> None:
    """Make `cls.gradient_checkpointing_enable` dispatch by identity: a guarded model goes through its guard, any
    other instance (a deep copy of a guarded model, another model of the class) straight to the real method."""
    held, users = _PATCHED.get(cls, (None, 0))
    if users:
        _PATCHED[cls] = (held, users + 1)
        return
    held = cls.__dict__.get("gradient_checkpointing_enable", _MISSING)
    real = cls.gradient_checkpointing_enable  # type: ignore[attr-defined]

    @functools.wraps(real)
    def gradient_checkpointing_enable(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = _GUARDS.get(self)
        bound = real.__get__(self, type(self))
        if guard is None:
            return bound(*args, **kwargs)
        return guard.enable(bound, *args, **kwargs)

    setattr(gradient_checkpointing_enable, _MARK, True)
    cls.gradient_checkpointing_enable = gradient_checkpointing_enable  # type: ignore[attr-defined]
    _PATCHED[cls] = (held, 1)


def _unpatch_class(cls: type) -> None:
    held, users = _PATCHED.get(cls, (None, 0))
    if users > 1:
        _PATCHED[cls] = (held, users - 1)
        return
    _PATCHED.pop(cls, None)
    if getattr(cls.__dict__.get("gradient_checkpointing_enable"), _MARK, False):
        if held is _MISSING:
            delattr(cls, "gradient_checkpointing_enable")
        else:
            cls.gradient_checkpointing_enable = held  # type: ignore[attr-defined]


class EnableGuard:
    """Records the live checkpointing of a model (block flags, checkpoint functions) and restores it after every
    re-enable.

    Args:
        model: the model the Trainer trains (a PEFT or DDP wrapper is unwrapped).
        layer_kwargs: the layer kwargs this transformers reads itself (`every_n_layers` from 5.16, `offload` from
            5.17; `capabilities.Capabilities.layer_kwargs()`); the others are taken out of the kwargs torch gets.
    """

    def __init__(self, model: Any, layer_kwargs: Collection[str]) -> None:
        self.base = ckpt.unwrap(model)
        self.layer_kwargs = frozenset(layer_kwargs)
        self.pattern: tuple[bool, ...] = ()
        self.funcs: dict[int, Any] = {}
        self._patched: type | None = None
        self.recorded: ckpt.Snapshot | None = None
        self.record()

    def record(self) -> None:
        """Take the model's current state as the one to keep (after the Trainer's enable, and after each change the
        plugin makes on purpose)."""
        self.pattern = probe.block_pattern(self.base)
        self.recorded = ckpt.snapshot(self.base)
        self.funcs = self.recorded.real_functions()

    def install(self) -> None:
        if self.base.__dict__.get("gradient_checkpointing_enable") is not None:
            return  # someone (TRL's selective checkpointing) wraps it on the instance already: leave it alone
        if _GUARDS.get(self.base) is not None:
            return  # an earlier guard stands in already
        _GUARDS.set(self.base, self)
        _patch_class(type(self.base))
        self._patched = type(self.base)

    def enable(self, original: Any, gradient_checkpointing_kwargs: Any = None, **kwargs: Any) -> Any:
        """The guarded `gradient_checkpointing_enable`: hand the layer kwargs over or take them out, call `original`
        (the model's own method, bound), then put back what was recorded."""
        torch_kwargs = dict(gradient_checkpointing_kwargs or {})
        for key in LAYER_KWARGS:
            value = torch_kwargs.pop(key, None)
            if key in self.layer_kwargs and value is not None:
                kwargs.setdefault(key, value)
        result = original(gradient_checkpointing_kwargs=torch_kwargs or None, **kwargs)
        self.reapply()
        return result

    def remove(self) -> None:
        if _GUARDS.get(self.base) is self:
            _GUARDS.pop(self.base)
        patched, self._patched = self._patched, None
        if patched is not None:
            _unpatch_class(patched)

    def drifted(self) -> list[tuple[str, Any]]:
        """(what, found) where the live model no longer holds the recorded pattern or checkpoint function."""
        found: list[tuple[str, Any]] = []
        pattern = probe.block_pattern(self.base)
        if self.pattern and pattern != self.pattern:
            found.append(("layer_pattern", pattern))
        for module, func in ckpt.functions(self.base):
            want = self.funcs.get(id(module))
            func = ckpt.real(func)
            if want is not None and _wrapped(func) is not _wrapped(want):
                found.append(("checkpoint_function", getattr(_wrapped(func), "__name__", repr(func))))
                break
        return found

    def reapply(self) -> None:
        """Put back the recorded flags and, for every module, the recorded checkpoint function (its wrapper and
        keywords) with the `use_reentrant` the module runs now."""
        if self.recorded is None or (not self.pattern and not self.funcs):
            return
        ckpt.restore(self.recorded, keep_use_reentrant=True)


def _wrapped(func: Any) -> Any:
    return func.func if isinstance(func, functools.partial) else func


def every_n_pattern(blocks: int, n: int) -> tuple[bool, ...]:
    """transformers' `every_n_layers` (5.16+): block `i` checkpoints when `i % n == 0`."""
    return tuple(i % max(int(n), 1) == 0 for i in range(blocks))
