"""Keep what was enabled across re-enables, and tell the run of each one.

TRL's DPO, GRPO, KTO and RLOO re-enable checkpointing every step with the raw argument kwargs: that puts
`every_n_layers` / `offload` into torch's kwargs (every layer checkpointed again, the offload wrapper replaced, and with
reentrant `ValueError: Unexpected keyword arguments: every_n_layers`; reproduced on 5.23), which a transformers before
5.16 (`every_n_layers`) or 5.17 (`offload`) does not understand at all, and may bring back a `use_reentrant` the plugin
repaired away. `EnableGuard` stands in for the model's `gradient_checkpointing_enable` through its class (by identity:
a deep copy enables its own; PEFT's `__getattr__` and 5.x's `activation_checkpointing_enable` reach it), hands the
layer kwargs to transformers where it reads them or takes them out, and puts back the recorded flags and checkpoint
functions with the `use_reentrant` of the call.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Collection
from typing import Any

from ..core.kwargs import LAYER_KWARGS
from . import ckpt, probe
from .hooks import Hooks


class EnableGuard:
    """Watches the re-enables of a model's checkpointing; with `keep`, restores the recorded checkpointing after each
    (else only reports it to `after`, the run's drift check). `layer_kwargs`: those this transformers reads itself."""

    def __init__(
        self, model: Any, layer_kwargs: Collection[str], keep: bool = True, after: Callable[[], Any] | None = None
    ) -> None:
        self._base = weakref.ref(ckpt.unwrap(model))
        self.layer_kwargs = frozenset(layer_kwargs)
        self.keep = keep
        self.after = after
        self.record()

    @property
    def base(self) -> Any:
        """The guarded model (held weakly: the guard stays with a loop's model and never keeps it alive)."""
        return self._base()

    def record(self) -> None:
        """Take the model's current state as the one to keep (after the enable, and each change made on purpose)."""
        self.layout = ckpt.layout_of(self.base)
        self.recorded = ckpt.snapshot(self.base)
        self.funcs: dict[int, Any] = self.recorded.real_functions()

    def install(self, hooks: Hooks) -> None:
        """Stand in for the model's `gradient_checkpointing_enable` until the run's hooks go."""
        if self.base.__dict__.get("gradient_checkpointing_enable") is not None:
            return  # someone (TRL's selective checkpointing) wraps it on the instance already: leave it alone
        hooks.method(self.base, "gradient_checkpointing_enable", self.enable, lasting=True)

    def enable(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """The guarded `gradient_checkpointing_enable` (`original`: the model's own, bound)."""
        if self.keep:
            torch_kwargs = dict(kwargs.pop("gradient_checkpointing_kwargs", args[0] if args else None) or {})
            for key in LAYER_KWARGS:
                value = torch_kwargs.pop(key, None)
                if key in self.layer_kwargs and value is not None:
                    kwargs.setdefault(key, value)
            result = original(gradient_checkpointing_kwargs=torch_kwargs or None, **kwargs)
            self.reapply()
        else:
            result = original(*args, **kwargs)
        if self.after is not None:
            self.after()
        return result

    def drifted(self) -> list[tuple[str, Any]]:
        """(what, found) where the live model no longer holds the recorded pattern or checkpoint function."""
        found: list[tuple[str, Any]] = []
        pattern = probe.block_pattern(self.base)
        if self.layout.pattern and pattern != self.layout.pattern:
            found.append(("layer_pattern", pattern))
        for module, func in ckpt.functions(self.base):
            want = self.funcs.get(id(module))
            func = ckpt.real(func)
            if want is not None and _wrapped(func) is not _wrapped(want):
                found.append(("checkpoint_function", getattr(_wrapped(func), "__name__", repr(func))))
                break
        return found

    def reapply(self) -> None:
        """Put back the recorded flags and checkpoint functions with the `use_reentrant` each module runs now."""
        if len(self.layout) or self.funcs:
            ckpt.restore(self.recorded, keep_use_reentrant=True)


def _wrapped(func: Any) -> Any:
    return func.func if isinstance(func, functools.partial) else func
