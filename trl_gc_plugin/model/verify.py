"""Runtime verification, checked cheaply: did every trainable checkpointed block get a gradient at the first step
(`audit_gradients`), and did the arguments or the model drift from the decision (`Watch`, per step). Nothing here
decides or logs."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import ckpt, probe


@dataclass
class AuditResult:
    """Checkpointed blocks with trainable parameters that got no gradient at all, sorted by cause."""

    checked: int = 0
    broken: list[str] = field(default_factory=list)  # seen run reentrant with no input requiring grad
    unused: list[str] = field(default_factory=list)  # ran otherwise, or did not run: not checkpointing's doing
    unverified: list[str] = field(default_factory=list)  # their stack's first forward was not observed
    # only zero gradients: a recompute that differs from the forward (a side input a hook set and cleared) gives that
    zero: list[str] = field(default_factory=list)
    nonfinite_params: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.broken or self.unused or self.unverified)

    @property
    def suspicious(self) -> bool:
        """Some trainable block got no gradient or only zeros: worth comparing with no checkpointing."""
        return bool(self.broken or self.unused or self.unverified or self.zero)


def gradients_are_sharded(args: Any, model: Any = None) -> str | None:
    """Why `.grad` cannot be read off the parameters per rank, or None. DeepSpeed keeps gradients in its own
    buffers; FSDP1 in flat parameters sharded across ranks (a parameter whose shard lies on another rank has no
    `.grad` here even when it trains). FSDP2's per-parameter DTensor gradients can be read; so can DDP's, which is
    what runs when accelerate falls back from a FSDP request."""
    if getattr(args, "deepspeed", None) or getattr(args, "deepspeed_plugin", None) is not None:
        return "DeepSpeed keeps gradients in its own partitioned buffers"
    if model is None:
        fsdp = getattr(args, "fsdp", None)
        return "FSDP keeps gradients in sharded parameters" if fsdp not in ([], "", None) else None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch without distributed
        return None
    if isinstance(model, FullyShardedDataParallel) or any(
        isinstance(m, FullyShardedDataParallel) for m in ckpt.unwrap(model).modules()
    ):
        return "FSDP1 keeps gradients in flat parameters sharded across ranks"
    return None


def audit_gradients(model: Any, observation: Any = None) -> AuditResult:
    """Per block (those the first forward saw checkpointed, and every checkpointing block): it passes if any trainable
    parameter has a gradient (an unused expert is fine); one that has none is blamed on checkpointing only with the
    first forward's evidence (`observation`)."""
    import torch

    base = ckpt.unwrap(model)
    names = {id(m): n for n, m in base.named_modules()}
    modules = dict(base.named_modules())
    calls = dict(getattr(observation, "calls", {}) or {})
    observed_stacks = set(getattr(observation, "observed_stacks", []) or [])
    active = {id(m) for m, _ in ckpt.functions(base)}
    blocks = {names.get(id(b), type(b).__name__): b for b in ckpt.blocks(base) if id(b) in active}
    blocks.update({name: modules[name] for name in calls if name in modules})
    result = AuditResult()
    readable: list[tuple[str, str, Any]] = []  # (block, parameter, gradient)
    for prefix, block in blocks.items():
        trainable = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
        if not trainable:
            continue
        result.checked += 1
        with_grad = [(n, p.grad) for n, p in trainable if p.grad is not None]
        if not with_grad:
            call = calls.get(prefix)
            if call is not None and call.loses_gradients:
                result.broken.append(prefix)
            elif call is not None or _under_observed_stack(prefix, observed_stacks):
                result.unused.append(prefix)
            else:
                result.unverified.append(prefix)
        readable += [(prefix, f"{prefix}.{n}", _local(g)) for n, g in with_grad if g.device.type != "meta"]
    if readable:
        norms = torch._foreach_norm([g for _, _, g in readable])
        values = torch.stack([n.float() for n in norms]).tolist()
        result.nonfinite_params = [
            name for (_, name, _), v in zip(readable, values, strict=True) if not math.isfinite(v)
        ]
        nonzero = {owner for (owner, _, _), v in zip(readable, values, strict=True) if v != 0}
        result.zero = [prefix for prefix in dict.fromkeys(o for o, _, _ in readable) if prefix not in nonzero]
    return result


def _local(grad: Any) -> Any:
    """A DTensor gradient's local shard (FSDP2): checked per rank, no collective."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def _under_observed_stack(block: str, stacks: set[str]) -> bool:
    """The block lives under a stack whose first training forward was observed (so it did not run checkpointed)."""
    return any(stack == "" or block.startswith(stack + ".") for stack in stacks)


class Watch:
    """Per-step drift check: a few attribute reads against the decided `use_reentrant`. `baseline`: what the model runs
    at train begin, watched where nothing was decided (warn mode, a stand-back)."""

    def __init__(self, args: Any, model: Any, baseline: bool | None = None) -> None:
        self.args = args
        self.baseline = baseline
        start = probe.read_kwargs(args)
        # what the arguments hold (the run updates it when it writes them)
        self.args_value = start.get("use_reentrant") if start is not None else None
        funcs = ckpt.functions(ckpt.unwrap(model))
        # one module read per step: a re-enable rewrites every module's function at once (both held weakly)
        self._sentinel = _weak(funcs[0][0] if funcs else None)
        self._embeddings = _weak(probe.embeddings(model))
        self.dual_fields = probe.has_activation_fields(args)

    @property
    def embeddings(self) -> Any:
        return self._embeddings()

    def drift(self, decided: Any) -> list[tuple[str, Any]]:
        """(setting, value found) where the args no longer hold `args_value`, or the model `decided` (or `baseline`)."""
        found: list[tuple[str, Any]] = []
        kwargs = probe.read_kwargs(self.args)
        current = kwargs.get("use_reentrant") if kwargs is not None else None
        expected = decided if isinstance(decided, bool) else None
        if current is not self.args_value:
            found.append(("use_reentrant", current))
        elif self.dual_fields and self.args.gradient_checkpointing_kwargs is not kwargs:
            found.append(("gradient_checkpointing_kwargs", self.args.gradient_checkpointing_kwargs))
        m = self._sentinel()
        if m is not None and m.gradient_checkpointing:
            running = ckpt.use_reentrant(m._gradient_checkpointing_func)
            if running is not (expected if expected is not None else self.baseline):
                found.append(("model.use_reentrant", running))
        return found

    def input_hooks(self) -> int:
        return len(probe.input_grad_hook_keys(self.embeddings))

    def dedupe_input_hooks(self) -> int:
        """Keep the first input-require-grad hook on the embeddings, remove the others; returns how many went."""
        emb = self.embeddings
        keys = probe.input_grad_hook_keys(emb)
        for key in keys[1:]:
            for table in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                getattr(emb, table, {}).pop(key, None)
        return max(len(keys) - 1, 0)


def _weak(module: Any) -> Callable[[], Any]:
    return weakref.ref(module) if module is not None else lambda: None
