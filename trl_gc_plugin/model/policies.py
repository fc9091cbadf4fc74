"""The per-op policies of selective checkpointing (what a checkpointed block keeps for the backward). Their
`context_fn`s are what `ckpt.apply` writes; the planner's estimate (`planning.memory`) counts with the same `keeps` /
`lean_keeps`, so what it predicts is what runs."""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# aten packets whose outputs selective checkpointing keeps: the matmuls (nn.Linear lowers to mm/addmm below
# autograd; transformers 5.x runs MoE experts as `_grouped_mm`) and the fused attention kernels. `bmm`/`baddbmm` are
# kept only when their output is not square in its last two dimensions: eager attention's `QK^T` scores (b*a, s, s)
# are recomputed, its `scores @ V` is kept. An MoE router's gate is a matmul narrower than its input, kept by both
# policies: the recompute reads the forward's router logits bitwise, so `softmax` and `topk` route as the forward did
# (the concern of torchtitan #3146, which keeps `aten.topk` itself). `topk` is not kept: transformers' Mixtral and
# Qwen-MoE (`norm_topk_prob`) routers normalise its values in place (`/=`), and torch refuses a mutated cache entry at
# the first backward ("Tensor cached during selective activation checkpoint has been mutated", measured with torch
# 2.13 and 2.15).
_SAVE_NAMES = (
    "mm",
    "addmm",
    "_grouped_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
BMM_NAMES = ("bmm", "baddbmm")  # bmm(a, b); baddbmm(input, a, b)
_ATTENTION_NAMES = tuple(n for n in _SAVE_NAMES if "attention" in n)

_state: dict[str, Any] = {}


def _ops(*names: str) -> frozenset[Any]:
    import torch

    packets = [p for name in names if (p := getattr(torch.ops.aten, name, None)) is not None]
    return frozenset(getattr(packet, overload) for packet in packets for overload in packet.overloads())


def policy_state() -> dict[str, Any]:
    if not _state:
        from torch.utils import checkpoint as checkpoint_module
        from torch.utils.checkpoint import CheckpointPolicy

        _state.update(
            save=_ops(*_SAVE_NAMES),
            bmm=_ops("bmm"),
            baddbmm=_ops("baddbmm"),
            attention=_ops(*_ATTENTION_NAMES),
            mm=_ops("mm", "_grouped_mm"),
            addmm=_ops("addmm"),
            must_save=CheckpointPolicy.MUST_SAVE,
            recompute=CheckpointPolicy.PREFER_RECOMPUTE,
            forced=getattr(checkpoint_module, "_is_cacheable_effect", None),
        )
    return _state


def keeps(op: Any, args: tuple[Any, ...], state: dict[str, Any]) -> bool:
    """Whether selective keeps `op`'s output: the ops of `_SAVE_NAMES`, and what torch saves whatever the policy says
    (2.15+: an op with ordered effects, `_is_cacheable_effect`), so what is counted is what runs."""
    if op in state["save"] or (state["forced"] is not None and state["forced"](op)):
        return True
    if op in state["bmm"]:
        return bool(args[0].shape[-2] != args[1].shape[-1])
    if op in state["baddbmm"]:
        return bool(args[1].shape[-2] != args[2].shape[-1])
    return False


def _widens(op: Any, args: tuple[Any, ...], state: dict[str, Any]) -> bool:
    """A matmul whose output is wider than its input (an MLP's up and gate projections, a fused QKV projection, LoRA's
    `B`): its output costs the most bytes for the FLOPs recomputing it takes."""
    if op in state["mm"]:
        return bool(args[1].shape[-1] > args[0].shape[-1])
    if op in state["addmm"]:
        return bool(args[2].shape[-1] > args[1].shape[-1])
    return False


def lean_keeps(op: Any, args: tuple[Any, ...], state: dict[str, Any]) -> bool:
    return keeps(op, args, state) and not _widens(op, args, state)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep the outputs of matmuls and fused attention kernels (`keeps`), recompute everything else."""
    state = _state or policy_state()
    return state["must_save"] if keeps(op, args, state) else state["recompute"]


def lean_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """What `selective_policy` keeps less the outputs of widening matmuls: on a Llama block (hidden 512, 2 x 512 tokens)
    it keeps 53% of what selective keeps and recomputes the MLP's up and gate projections (38% of the block's FLOPs)."""
    state = _state or policy_state()
    return state["must_save"] if lean_keeps(op, args, state) else state["recompute"]


# --- the recompute computes what the forward computed -------------------------------------------------------------
# torch's checkpoint restores the RNG, autocast and the device for the recompute, not the scaled-dot-product attention
# backend: a forward run under `sdpa_kernel([SDPBackend.MATH])` and a backward outside it recompute with another kernel,
# which saves other tensors (`CheckpointError: Recomputed values ... have different metadata` under non-reentrant,
# torch 2.13 and 2.15, transformers 4.57 and 5.23). And a recomputed MoE router whose logits differ from the forward's
# (nondeterministic GEMMs, another kernel, bf16 near a top-k tie) sends tokens to other experts: a different number
# of saved tensors (verl #7016: `CheckpointError ... 1730 vs 178`) or, silently, other gradients. So every block the
# plugin manages runs a `context_fn` built here from parts: the selective / lean policy or, under full checkpointing,
# a policy that keeps only the router's logits (tokens x experts values), and the forward's attention backend
# re-entered around the recompute. Each part is a module-level object that pickles and compares by value.


def attention_state() -> tuple[tuple[bool, ...], tuple[int, ...]] | None:
    """The SDPA backends enabled now and their priority order; None where this torch has no such switches."""
    import torch

    names = _backend_names()
    if not names:
        return None
    flags = tuple(bool(getattr(torch._C, f"_get_{name}_sdp_enabled")()) for name in names)
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    return flags, tuple(order()) if order is not None else ()


def _backend_names() -> tuple[str, ...]:
    """The backend switches this torch has (`torch.nn.attention._backend_names`: cudnn, flash, mem_efficient, math,
    overrideable), those with both a getter and a setter."""
    import torch

    try:
        from torch.nn.attention import _backend_names as names  # type: ignore[attr-defined]
    except ImportError:
        return ()
    return tuple(
        n for n in names if hasattr(torch._C, f"_get_{n}_sdp_enabled") and hasattr(torch._C, f"_set_sdp_use_{n}")
    )


def set_attention_state(state: tuple[tuple[bool, ...], tuple[int, ...]]) -> None:
    import torch

    flags, order = state
    for name, on in zip(_backend_names(), flags, strict=False):
        getattr(torch._C, f"_set_sdp_use_{name}")(on)
    if order and hasattr(torch._C, "_set_sdp_priority_order"):
        torch._C._set_sdp_priority_order(list(order))


def _te_fp8() -> Any:
    """Whether Transformer Engine's `fp8_autocast` is on (None where TE is not imported: nothing is read)."""
    fp8 = sys.modules.get("transformer_engine.pytorch.fp8")
    manager = getattr(fp8, "FP8GlobalStateManager", None)
    return None if manager is None else bool(manager.is_fp8_enabled())


WATCHED: dict[str, Callable[[], Any]] = {"Transformer Engine's fp8_autocast": _te_fp8}
"""Forward contexts torch's checkpoint does not restore and the plugin cannot re-enter (TE's FP8 state lives in its
own global manager): read at each checkpointed forward and again in the recompute; a difference is said once, naming
the context, before torch's own `CheckpointError` metadata dump."""


def watched_states() -> tuple[Any, ...]:
    return tuple(read() for read in WATCHED.values())


class _Replayed:
    """A recompute context: enters `inner` (SAC's cached mode, or nothing) under the forward's attention backend,
    switched only where the backward runs under another one, and put back on the way out; says which watched
    context (`WATCHED`) the recompute runs outside of."""

    def __init__(self, inner: Any, state: Any, watched: tuple[Any, ...] = ()) -> None:
        self.inner, self.state, self.previous, self.watched = inner, state, None, watched

    def __enter__(self) -> Any:
        if self.state is not None and (now := attention_state()) != self.state:
            self.previous = now
            set_attention_state(self.state)
        if self.watched and (now_watched := watched_states()) != self.watched:
            _say_unreplayed(self.watched, now_watched)
        return self.inner.__enter__() if self.inner is not None else None

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc) if self.inner is not None else None
        finally:
            if self.previous is not None:
                set_attention_state(self.previous)
                self.previous = None


def router_keeps(experts: int, hidden: int, op: Any, args: tuple[Any, ...], state: dict[str, Any]) -> bool:
    """A matmul from the hidden size to the number of experts: an MoE router's logits (`F.linear(h, gate.weight)`,
    with or without bias, lowers to `mm` / `addmm`). An expert projection of the same shape would be kept too."""
    if op in state["mm"]:
        a, b = args[0], args[1]
    elif op in state["addmm"]:
        a, b = args[1], args[2]
    else:
        return False
    return bool(a.shape[-1] == hidden and b.shape[-1] == experts)


@dataclass(frozen=True)
class Faithful:
    """The `context_fn` of a block the plugin manages: `keep` (`selective` / `lean` policy, or `full`: nothing kept
    but the router's logits when `router` = (experts, hidden) is set), and the forward's attention backend replayed.
    Under `torch.compile` (which needs two dispatch modes) only the save policy is returned."""

    keep: str = "full"
    router: tuple[int, int] | None = None

    def policy(self) -> Any:
        if self.keep == "selective":
            return selective_policy
        if self.keep == "lean":
            return lean_policy
        if self.router is not None:
            return functools.partial(_routing_policy, *self.router)
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as torch's `noop_context_fn`: nothing of the plugin goes into a model users save; the copy
        checkpoints as transformers would without the plugin."""
        return (getattr, (_Import("torch.utils.checkpoint"), "noop_context_fn"))

    def __copy__(self) -> Faithful:
        return self  # immutable; a copy in memory (a deep-copied reference model) keeps it

    def __deepcopy__(self, memo: Any) -> Faithful:
        return self

    def __call__(self) -> tuple[Any, Any]:
        import torch
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        policy = self.policy()
        if torch.compiler.is_compiling():
            return create_selective_checkpoint_contexts(policy or _recompute_all)
        forward, recompute = create_selective_checkpoint_contexts(policy) if policy else (_NULL, None)
        return forward, _Replayed(recompute, attention_state(), watched_states())


class _Import:
    """Pickled as `importlib.import_module(name)` (only its reduction is ever written)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (importlib.import_module, (self.name,))


def _routing_policy(experts: int, hidden: int, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    state = _state or policy_state()
    return state["must_save"] if router_keeps(experts, hidden, op, args, state) else state["recompute"]


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return (_state or policy_state())["recompute"]


_NULL = contextlib.nullcontext()


_SELECTIVE, _LEAN = Faithful("selective"), Faithful("lean")


def selective_context() -> tuple[Any, Any]:
    """The planner's selective blocks' `context_fn`: a plain module-level function (a partial holding it pickles, and
    dynamo accepts it under `torch.compile`, where it refuses a dataclass instance: `checkpoint not implemented for
    FrozenDataClassVariable context_fn`, torch 2.13); what it returns there is SAC's two modes, as torch requires."""
    return _compiled(selective_policy) or _SELECTIVE()


def lean_context() -> tuple[Any, Any]:
    return _compiled(lean_policy) or _LEAN()


def _compiled(policy: Any) -> tuple[Any, Any] | None:
    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(policy) if torch.compiler.is_compiling() else None


full_context = Faithful()
"""A fully checkpointed block without a router: the attention backend replayed, nothing kept (never written under
`torch.compile`)."""


def faithful_of(context_fn: Any) -> Faithful | None:
    """The plugin's `Faithful` behind a `context_fn` it writes; None for a user's own (or none)."""
    if context_fn is selective_context:
        return _SELECTIVE
    if context_fn is lean_context:
        return _LEAN
    return context_fn if isinstance(context_fn, Faithful) else None


def is_ours(context_fn: Any) -> bool:
    """Whether a `context_fn` is one the plugin writes (a user's own is kept as it is)."""
    return faithful_of(context_fn) is not None


def _say_unreplayed(forward: tuple[Any, ...], recompute: tuple[Any, ...]) -> None:
    from .._base import report

    for name, was, now in zip(WATCHED, forward, recompute, strict=True):
        if was != now:
            report.note(
                f"the checkpointed forward ran with {name} = {was!r}, its recompute in the backward runs with {now!r}: "
                "torch's checkpoint does not restore it, so the recompute computes something else (a CheckpointError "
                "'Recomputed values ... have different metadata' or other gradients follow). Run the backward under "
                "the same context as the forward, or checkpoint outside it.",
                "warning",
                report.is_main_process(),
            )
