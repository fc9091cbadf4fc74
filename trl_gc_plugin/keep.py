"""Keep what was enabled: the layer pattern, the offload wrapper and the plugin's extra keywords survive re-enables.

TRL's DPO, GRPO, KTO and RLOO switch checkpointing off and back on every step with
`model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)`: the raw argument kwargs. That puts
`every_n_layers` / `offload` into the kwargs torch's checkpoint gets (every layer checkpointed again, the offload
wrapper replaced by plain `checkpoint`, and with reentrant `ValueError: Unexpected keyword arguments:
every_n_layers` in the next forward; reproduced on 5.23); a transformers before 5.16 (`every_n_layers`) or 5.17
(`offload`) does not understand them at all. `EnableGuard` stands in
for the model's `gradient_checkpointing_enable` (an instance attribute on the unwrapped model, which PEFT wrappers
reach through their `__getattr__`; transformers 5's `activation_checkpointing_enable` routes through it too) for the
duration of training: it hands `every_n_layers` / `offload` to transformers as arguments where it reads them (as
detected, `capabilities.py`) or takes them out, calls the real method, and then puts back the recorded per-block flags and the
checkpoint function's wrapper and extra keywords (a plan's `context_fn`), leaving `use_reentrant` to the call (the
drift check watches that one). `remove()` deletes the instance attribute: the model is as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any

from . import ckpt, probe

LAYER_KWARGS = ("every_n_layers", "offload")
_MARK = "__trl_gc_plugin_enable_guard__"


class EnableGuard:
    """Records the live checkpointing of a model (block flags, checkpoint functions) and restores it after every
    re-enable.

    Args:
        model: the model the Trainer trains (a PEFT or DDP wrapper is unwrapped).
        layer_kwargs: the layer kwargs this transformers reads itself (`every_n_layers` from 5.16, `offload` from
            5.17; `capabilities.Capabilities.layer_kwargs()`); the others are taken out of the kwargs torch gets.
    """

    def __init__(self, model: Any, layer_kwargs: Collection[str]) -> None:
        self.base = probe.unwrap(model)
        self.layer_kwargs = frozenset(layer_kwargs)
        self.pattern: tuple[bool, ...] = ()
        self.funcs: dict[int, Any] = {}
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
            return  # someone (TRL's selective checkpointing, an earlier guard) wraps it already: leave it alone
        original = self.base.gradient_checkpointing_enable

        def gradient_checkpointing_enable(gradient_checkpointing_kwargs: Any = None, **kwargs: Any) -> Any:
            torch_kwargs = dict(gradient_checkpointing_kwargs or {})
            for key in LAYER_KWARGS:
                value = torch_kwargs.pop(key, None)
                if key in self.layer_kwargs and value is not None:
                    kwargs.setdefault(key, value)
            result = original(gradient_checkpointing_kwargs=torch_kwargs or None, **kwargs)
            self.reapply()
            return result

        setattr(gradient_checkpointing_enable, _MARK, True)
        self.base.gradient_checkpointing_enable = gradient_checkpointing_enable

    def remove(self) -> None:
        current = self.base.__dict__.get("gradient_checkpointing_enable")
        if current is not None and getattr(current, _MARK, False):
            del self.base.__dict__["gradient_checkpointing_enable"]

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
