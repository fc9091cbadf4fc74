"""The per-op policies of selective checkpointing (what a checkpointed block keeps for the backward). Their
`context_fn`s are what `ckpt.apply` writes; the planner's estimate (`planning.memory`) counts with the same `keeps` /
`lean_keeps`, so what it predicts is what runs."""

from __future__ import annotations

from typing import Any

# aten packets whose outputs selective checkpointing keeps: the matmuls (nn.Linear lowers to mm/addmm below
# autograd; transformers 5.x runs MoE experts as `_grouped_mm`) and the fused attention kernels. `bmm`/`baddbmm` are
# kept only when their output is not square in its last two dimensions: eager attention's `QK^T` scores (b*a, s, s)
# are recomputed, its `scores @ V` is kept. An MoE router's gate is a matmul narrower than its input, kept by both
# policies: the recompute reads the forward's router logits bitwise, so `softmax` and `topk` route as the forward did
# (the concern of torchtitan #3146, which keeps `aten.topk` itself). `topk` is not kept: transformers' Mixtral and
# Qwen-MoE (`norm_topk_prob`) routers normalise its values in place (`/=`), and torch refuses a mutated cache entry at the first backward
# ("Tensor cached during selective activation checkpoint has been mutated", measured with torch 2.13 and 2.15).
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


def selective_context() -> Any:
    """A fresh pair of contexts per call (a shared pair breaks the second); module-level, so a partial pickles."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy)


def lean_context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(lean_policy)
