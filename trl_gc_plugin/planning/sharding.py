"""How sharded training holds a model's parameters, for memory plans: the rank's share of the gradients, the
parameters held whole while a block or the loss head computes (DeepSpeed ZeRO-3, FSDP1, FSDP2), and a cheap reading
of what is held whole now, for the first step's check. Read from the live model; the arithmetic is the planner's
(`planner.gathered_bytes`, `planner.zero3_gathered`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..model import ckpt, probe


def zero3_window(args: Any) -> int | None:
    """Under DeepSpeed ZeRO-3, the parameter elements it may keep gathered besides the module computing (the config's
    reuse distance and prefetch bucket, `_deepspeed.DeepSpeedFacts.gather_window`); None otherwise."""
    facts = probe.deepspeed_facts(args) if probe.zero_stage(args) == 3 else None
    return facts.gather_window if facts is not None else None


def gathered_parameter_bytes(model: Any, zero3_window: int | None = None) -> int:
    """Under DeepSpeed ZeRO-3, FSDP1 or FSDP2, the parameters held whole besides the activations while a block or the
    loss head computes; 0 for a model without sharded parameters.

    - All gather a block's parameters and prefetch the next block's; the loss head needs its own and the last
      block's (`planner.gathered_bytes`).
    - ZeRO-3 also keeps what it will use again within `zero3_window` elements (its reuse distance and prefetch
      bucket, `_deepspeed.DeepSpeedFacts.gather_window`) and its persistent parameters (`ds_persist`): the whole of
      a model smaller than the window.
    - FSDP1 keeps its root unit and every unit that does not reshard after forward whole (`fsdp1_layout`); FSDP2 the
      groups that do not reshard after forward and run before the loss head (`fsdp2_layout`)."""
    from . import memory
    from .planner import gathered_bytes, zero3_gathered

    base = ckpt.unwrap(model)
    fsdp1 = fsdp1_layout(model)
    if fsdp1 is not None:
        blocks = [fsdp1.unit_bytes.get(id(block), 0) for _, block in memory.named_blocks(base)]
        return gathered_bytes(blocks, 0, held=fsdp1.held_bytes)
    fsdp2 = fsdp2_layout(model)
    if fsdp2 is not None:
        return gathered_bytes(list(fsdp2.block_bytes), fsdp2.head_bytes, held=fsdp2.held_bytes)
    params = [p for p in base.parameters() if hasattr(p, "ds_numel")]
    if not params:
        return 0

    def whole(items: Any) -> int:
        return sum(int(p.ds_numel) * p.element_size() for p in items if hasattr(p, "ds_numel"))

    blocks = [whole(block.parameters()) for _, block in memory.named_blocks(base)]
    head_module = probe.embeddings(base, "output")
    head = whole(head_module.parameters()) if head_module is not None else 0
    gathered = gathered_bytes(blocks, head)
    if zero3_window is not None:
        itemsize = max(p.element_size() for p in params)
        persistent = whole(p for p in params if getattr(p, "ds_persist", False))
        gathered = zero3_gathered(gathered, blocks, whole(params), zero3_window * itemsize, persistent)
    return gathered


@dataclasses.dataclass(frozen=True)
class Fsdp1Layout:
    """How FSDP1 (`FullyShardedDataParallel`) holds a model on this rank, read from its flat parameters.

    Args:
        grad_fraction (`float`): the rank's share of the flat parameters, and so of their gradients.
        held_bytes (`int`): the whole bytes of the units FSDP1 keeps whole from their forward to their backward: the
            root (FSDP1 does not free the root after forward) and every unit whose strategy does not reshard after
            forward (`SHARD_GRAD_OP`, `NO_SHARD`).
        unit_bytes (`dict[int, int]`): the whole bytes of each other unit, by the id of the module it wraps.
    """

    grad_fraction: float
    held_bytes: int
    unit_bytes: dict[int, int]


def fsdp1_layout(model: Any) -> Fsdp1Layout | None:
    """The FSDP1 layout of `model` (the root wrapper, or a model holding wrapped units), None without FSDP1 units or
    when torch's flat parameters cannot be read (private attributes of `torch.distributed.fsdp`, read in torch 2.13:
    `_flat_param`, its `_sharded_size` and `_unpadded_unsharded_size`, the handle's `_sharding_strategy`; the
    strategies that reshard after forward are `_runtime_utils.RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES`)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._runtime_utils import RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES
    except ImportError:  # torch without distributed, or another torch's layout
        return None
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    if not units:
        return None
    nested = {id(m) for unit in units for m in unit.modules() if m is not unit}
    local = whole = held = 0
    unit_bytes: dict[int, int] = {}
    try:
        for unit in units:
            flat = unit._flat_param
            if flat is None:  # a unit without parameters of its own
                continue
            size = int(flat._unpadded_unsharded_size.numel())
            local, whole = local + int(flat._sharded_size.numel()), whole + size  # numel(): as gathered now
            root = id(unit) not in nested
            kept = root or unit._handle._sharding_strategy not in RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES
            if kept:
                held += size * flat.element_size()
            else:
                unit_bytes[id(unit.module)] = size * flat.element_size()
    except AttributeError:
        return None
    return Fsdp1Layout(min(1.0, local / whole) if whole else 1.0, held, unit_bytes)


def is_dtensor(p: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(p, DTensor)


@dataclasses.dataclass(frozen=True)
class Fsdp2Layout:
    """How FSDP2 (`fully_shard`) holds a model on this rank, read from its parameter groups (`FSDPParam`s: the same
    whether a group is gathered or sharded at the moment of reading).

    Args:
        grad_fraction (`float`): the rank's share of the parameters it shards, and so of their gradients (1/N over
            the shard dimension; HSDP's replicated dimension keeps whole copies).
        held_bytes (`int`): the whole bytes of the groups kept whole while the blocks compute: those that do not
            reshard after forward and run before the loss head (the root's own parameters when left to torch's
            default, which keeps the root whole, `_auto_reshard_after_forward` in torch 2.13's
            `_fully_shard/_fsdp_state.py`; blocks' groups with `reshard_after_forward=False`, which accumulate; a kept
            group holding the input embeddings, as accelerate groups tied embeddings with the final norm and head).
        block_bytes (`tuple[int, ...]`): each block's whole bytes not held (`memory.named_blocks` order).
        head_bytes (`int`): the output embeddings' whole bytes not held, and a kept group after the blocks (the final
            norm and head), whole from the loss head on.
    """

    grad_fraction: float
    held_bytes: int
    block_bytes: tuple[int, ...]
    head_bytes: int


def units_inside_blocks(model: Any) -> list[str]:
    """The FSDP2 units (`fully_shard` modules) strictly inside a checkpointed block, by name: each gathers and frees its
    parameters from hooks that run inside the block's checkpointed region, on the forward and on the recompute."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    base = ckpt.unwrap(model)
    found = []
    for block_name, block in _named(base, ckpt.blocks(base)):
        for name, module in block.named_modules():
            if name and isinstance(module, FSDPModule):
                found.append(f"{block_name}.{name}")
    return found


def _named(base: Any, blocks: list[Any]) -> list[tuple[str, Any]]:
    names = {id(m): n for n, m in base.named_modules()}
    return [(names.get(id(b), f"<block {i}>"), b) for i, b in enumerate(blocks)]


def fsdp2_layout(model: Any) -> Fsdp2Layout | None:
    """The FSDP2 layout of `model`, None without FSDP2 (no `FSDPModule`). Reads private attributes of torch's FSDP2
    (`_get_fsdp_state`, `_fsdp_param_groups`, `post_forward_mesh_info`, `FSDPParam._module_info`, `_orig_size`; torch
    2.13): raises AttributeError where another release lays them out otherwise."""
    from . import memory

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    base = ckpt.unwrap(model)
    modules = [m for m in base.modules() if isinstance(m, FSDPModule)]
    if not modules:
        return None
    blocks = [block for _, block in memory.named_blocks(base)]
    block_of = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    embeddings, heads = _module_ids(base, "input"), _module_ids(base, "output")
    per_block, held, head, local, whole = [0] * len(blocks), 0, 0, 0, 0
    seen: set[int] = set()
    for i, module in enumerate(modules):
        state = module._get_fsdp_state()
        for group in state._fsdp_param_groups:
            if id(group) in seen:  # one group of several modules (accelerate's final norm and head)
                continue
            seen.add(id(group))
            sizes = [(id(fp._module_info.module), _whole_bytes(fp, group)) for fp in group.fsdp_params]
            kept = group.post_forward_mesh_info is None
            before = any(owner in block_of or owner in embeddings for owner, _ in sizes)
            if (i == 0 and state._auto_reshard_after_forward) or (kept and before):
                held += sum(size for _, size in sizes)
            elif kept:
                head += sum(size for _, size in sizes)
            else:  # gathered while its module computes: a block's, or the head's (resharded input embeddings: neither)
                for owner, size in sizes:
                    if owner in block_of:
                        per_block[block_of[owner]] += size
                    elif owner in heads:
                        head += size
            local += sum(int(fp.sharded_param.to_local().numel()) for fp in group.fsdp_params)
            whole += sum(int(fp._orig_size.numel()) for fp in group.fsdp_params)
    return Fsdp2Layout(local / whole if whole else 1.0, held, tuple(per_block), head)


def _whole_bytes(fp: Any, group: Any) -> int:
    """An `FSDPParam`'s whole bytes in the dtype it gathers in: its own `param_dtype` (set at FSDP2's lazy init, on the
    first forward), else its mixed-precision policy's (per parameter from torch 2.15, `FSDPParam.mp_policy`, where
    `param_dtype_override_fn` may keep a parameter in its own dtype; the group's `mp_policy` before), else its own
    dtype."""
    policy = getattr(fp, "mp_policy", None) or getattr(group, "mp_policy", None)
    dtype = getattr(fp, "param_dtype", None) or getattr(policy, "param_dtype", None) or fp.sharded_param.dtype
    return int(fp._orig_size.numel()) * dtype.itemsize


def _module_ids(base: Any, side: str) -> set[int]:
    module = probe.embeddings(base, side)
    return {id(m) for m in module.modules()} if module is not None else set()


def held_sampler(model: Any) -> Callable[[], int] | None:
    """A function that says how many bytes of sharded parameters are held whole now (gathered, or being gathered),
    or None without ZeRO-3 / FSDP1 / FSDP2 or when their state cannot be read. Each call reads one flag per
    parameter (ZeRO-3's `ds_status`, FSDP2's `sharded_state`) or per FSDP1 unit (whether its padded whole flat
    parameter has storage): a few microseconds per hundred parameters."""
    base = ckpt.unwrap(model)
    try:
        zero3 = [(p, int(p.ds_numel) * p.element_size()) for p in base.parameters() if hasattr(p, "ds_status")]
        if zero3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            away = ZeroParamStatus.NOT_AVAILABLE
            return lambda: sum(size for p, size in zero3 if p.ds_status != away)
        fsdp1 = _fsdp1_flats(model)
        if fsdp1:
            return lambda: sum(size for flat, size in fsdp1 if flat._full_param_padded.untyped_storage().size() > 0)
        fsdp2 = _fsdp2_params(base)
        if fsdp2:
            from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

            return lambda: sum(size for fp, size in fsdp2 if fp.sharded_state != ShardedState.SHARDED)
    except (AttributeError, ImportError):  # another release's internals: no reading
        return None
    return None


def _fsdp1_flats(model: Any) -> list[tuple[Any, int]]:
    """FSDP1's flat parameters that gather into a padded whole one, with their whole bytes."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    flats = [m._flat_param for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    return [
        (flat, int(flat._unpadded_unsharded_size.numel()) * flat.element_size())
        for flat in flats
        if flat is not None and hasattr(flat, "_full_param_padded")
    ]


def _fsdp2_params(base: Any) -> list[tuple[Any, int]]:
    """FSDP2's parameters (its `FSDPParam`s), with their whole bytes in the dtype they gather in."""
    from torch.distributed.fsdp import FSDPModule

    groups = {
        id(g): g for m in base.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups
    }
    return [(fp, _whole_bytes(fp, group)) for group in groups.values() for fp in group.fsdp_params]


def watch_held(model: Any, sample: Callable[[], int]) -> tuple[dict[str, Any], Callable[[], None]]:
    """Sample `sample()` at the start of the forward of every module that holds parameters of its own (where
    ZeRO-3 gathers, inside each FSDP unit), in training; the record keeps the largest (`max`), or why sampling
    stopped (`failed`). Returns the record
    and a function that removes the hooks. One forward of a 70B Llama: about 700 samples of 700 flags, 23 ms of flag
    reads on this CPU (measured with stand-in objects of the same count)."""
    record: dict[str, Any] = {"max": 0, "failed": None}

    def hook(module: Any, args: Any) -> None:
        if module.training and record["failed"] is None:
            try:
                record["max"] = max(record["max"], sample())
            except Exception as exc:  # a plugin bug never stops training: no more samples, said after the forward
                record["failed"] = f"{type(exc).__name__}: {exc}"

    base = ckpt.unwrap(model)
    handles = [m.register_forward_pre_hook(hook) for m in base.modules() if next(m.parameters(False), None) is not None]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return record, remove
