"""Keep what was enabled, and see every re-enable: the layer pattern, the offload wrapper and the plugin's keywords
survive re-enables, and the run hears of each one.

TRL's DPO, GRPO, KTO and RLOO switch checkpointing off and back on every step with
`model.gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)`: the raw argument kwargs. That puts
`every_n_layers` / `offload` into the kwargs torch's checkpoint gets (every layer checkpointed again, the offload
wrapper replaced by plain `checkpoint`, and with reentrant `ValueError: Unexpected keyword arguments: every_n_layers`
in the next forward; reproduced on 5.23); a transformers before 5.16 (`every_n_layers`) or 5.17 (`offload`) does not
understand them at all; a loop may re-enable with the `use_reentrant` the plugin repaired away. `EnableGuard` stands
in for the model's `gradient_checkpointing_enable` for the run, through its class (`hooks.Hooks.method`: by identity,
so a deep copy made meanwhile enables its own checkpointing; PEFT wrappers reach it through their `__getattr__`;
transformers 5's `activation_checkpointing_enable` routes through it too): it hands `every_n_layers` / `offload` to
transformers where it reads them (as detected, `capabilities.py`) or takes them out, calls the real method, puts back
the recorded per-block flags and checkpoint functions (a plan's `context_fn`) with the `use_reentrant` of the call,
and tells the run, whose drift check puts back the decided `use_reentrant`.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Collection
from typing import Any

from ..core.layout import Layout
from . import ckpt, probe
from .hooks import Hooks

LAYER_KWARGS = ("every_n_layers", "offload")


class EnableGuard:
    """Watches the re-enables of a model's checkpointing and, where the run enabled something to keep (`keep`), records
    the live checkpointing (block flags, checkpoint functions) and restores it after every re-enable.

    Args:
        model: the model the run trains (a PEFT or DDP wrapper is unwrapped).
        layer_kwargs: the layer kwargs this transformers reads itself (`every_n_layers` from 5.16, `offload` from
            5.17; `capabilities.Capabilities.layer_kwargs()`); the others are taken out of the kwargs torch gets.
        keep (`bool`): restore the recorded checkpointing after a re-enable (a layer pattern, an offload wrapper, a
            memory plan); else the re-enable runs as called and is only reported to `after`.
        after (`Callable`, *optional*): called after every re-enable (the run's drift check).
    """

    def __init__(
        self, model: Any, layer_kwargs: Collection[str], keep: bool = True, after: Callable[[], Any] | None = None
    ) -> None:
        self._base = weakref.ref(ckpt.unwrap(model))
        self.layer_kwargs = frozenset(layer_kwargs)
        self.keep = keep
        self.after = after
        self.layout = Layout(())
        self.funcs: dict[int, Any] = {}
        self.recorded: ckpt.Snapshot | None = None
        self.record()

    @property
    def base(self) -> Any:
        """The guarded model (held weakly: the guard stays with a loop's model and never keeps it alive)."""
        return self._base()

    def record(self) -> None:
        """Take the model's current state as the one to keep (after the Trainer's enable, and after each change the
        plugin makes on purpose)."""
        self.layout = ckpt.layout_of(self.base)
        self.recorded = ckpt.snapshot(self.base)
        self.funcs = self.recorded.real_functions()

    def install(self, hooks: Hooks) -> None:
        """Stand in for the model's `gradient_checkpointing_enable` through its class (`hooks.method`: dispatched by
        identity, so a copy of the model enables its own checkpointing), until the run's hooks go."""
        if self.base.__dict__.get("gradient_checkpointing_enable") is not None:
            return  # someone (TRL's selective checkpointing) wraps it on the instance already: leave it alone
        hooks.method(self.base, "gradient_checkpointing_enable", self.enable, lasting=True)

    def enable(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """The guarded `gradient_checkpointing_enable`: with `keep`, hand the layer kwargs over or take them out, call
        `original` (the model's own method, bound), then put back what was recorded; then tell `after`."""
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
        """Put back the recorded flags and, for every module, the recorded checkpoint function (its wrapper and
        keywords) with the `use_reentrant` the module runs now."""
        if self.recorded is None or (not len(self.layout) and not self.funcs):
            return
        ckpt.restore(self.recorded, keep_use_reentrant=True)


def _wrapped(func: Any) -> Any:
    return func.func if isinstance(func, functools.partial) else func
