"""How sharded training (DeepSpeed ZeRO-3, FSDP1, FSDP2) holds a live model's parameters, for memory plans: the rank's
share of the gradients, what is held whole while a block or the loss head computes, and a cheap reading of what is
held whole now, for the first step's check."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..model import ckpt, probe
from .memory import named_blocks


def zero3_window(args: Any) -> int | None:
    """Under ZeRO-3, the parameter elements it may keep gathered besides the module computing; None otherwise."""
    facts = probe.deepspeed_facts(args) if probe.zero_stage(args) == 3 else None
    return facts.gather_window if facts is not None else None


def gathered_parameter_bytes(model: Any, zero3_window: int | None = None) -> int:
    """The sharded parameters held whole besides the activations while a block or the loss head computes
    (`planner.gathered_bytes`; ZeRO-3 also keeps what it reuses within `zero3_window` elements and its persistent
    parameters); 0 without sharded parameters."""
    from .planner import gathered_bytes, zero3_gathered

    base = ckpt.unwrap(model)
    fsdp1 = fsdp1_layout(model)
    if fsdp1 is not None:
        blocks = [fsdp1.unit_bytes.get(id(block), 0) for _, block in named_blocks(base)]
        return gathered_bytes(blocks, 0, held=fsdp1.held_bytes)
    fsdp2 = fsdp2_layout(model)
    if fsdp2 is not None:
        return gathered_bytes(list(fsdp2.block_bytes), fsdp2.head_bytes, held=fsdp2.held_bytes)
    params = [p for p in base.parameters() if hasattr(p, "ds_numel")]
    if not params:
        return 0

    def whole(items: Any) -> int:
        return sum(int(p.ds_numel) * p.element_size() for p in items if hasattr(p, "ds_numel"))

    blocks = [whole(block.parameters()) for _, block in named_blocks(base)]
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
    """How FSDP1 holds a model on this rank: the rank's share of the gradients, the whole bytes of the units kept whole
    from forward to backward (the root, and units that do not reshard after forward), and of each other unit by the id
    of the module it wraps."""

    grad_fraction: float
    held_bytes: int
    unit_bytes: dict[int, int]


def fsdp1_layout(model: Any) -> Fsdp1Layout | None:
    """The FSDP1 layout of `model`, None without FSDP1 units or where torch's private flat-parameter attributes (read
    in torch 2.13) are laid out otherwise."""
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
    """How FSDP2 holds a model on this rank. `held_bytes`: groups kept whole while the blocks compute (not resharded
    after forward and run before the loss head: the root by torch's default, a kept group holding tied input
    embeddings); `block_bytes`: each block's other whole bytes; `head_bytes`: those whole from the loss head on."""

    grad_fraction: float
    held_bytes: int
    block_bytes: tuple[int, ...]
    head_bytes: int


def units_inside_blocks(model: Any) -> list[str]:
    """The names of the FSDP2 units strictly inside a checkpointed block (their gather hooks run in the checkpoint)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return []
    return [
        f"{block_name}.{name}"
        for block_name, block in named_blocks(model)
        for name, module in block.named_modules()
        if name and isinstance(module, FSDPModule)
    ]


def fsdp2_layout(model: Any) -> Fsdp2Layout | None:
    """The FSDP2 layout of `model`, None without FSDP2; reads torch 2.13's private attributes (AttributeError where
    another release lays them out otherwise)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    base = ckpt.unwrap(model)
    modules = [m for m in base.modules() if isinstance(m, FSDPModule)]
    if not modules:
        return None
    blocks = [block for _, block in named_blocks(base)]
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
    """An `FSDPParam`'s whole bytes in the dtype it gathers in: its `param_dtype` (set at lazy init), else its
    mixed-precision policy's (per parameter from torch 2.15, the group's before), else its own."""
    policy = getattr(fp, "mp_policy", None) or getattr(group, "mp_policy", None)
    dtype = getattr(fp, "param_dtype", None) or getattr(policy, "param_dtype", None) or fp.sharded_param.dtype
    return int(fp._orig_size.numel()) * dtype.itemsize


def _module_ids(base: Any, side: str) -> set[int]:
    module = probe.embeddings(base, side)
    return {id(m) for m in module.modules()} if module is not None else set()


def held_sampler(model: Any) -> Callable[[], int] | None:
    """A function that says how many bytes of sharded parameters are held whole now (one flag read per parameter or
    FSDP1 unit), or None without ZeRO-3 / FSDP1 / FSDP2 or when their state cannot be read."""
    base = ckpt.unwrap(model)
    try:
        zero3 = [(p, int(p.ds_numel) * p.element_size()) for p in base.parameters() if hasattr(p, "ds_status")]
        if zero3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            away = ZeroParamStatus.NOT_AVAILABLE
            return lambda: sum(size for p, size in zero3 if p.ds_status != away)
        from torch.distributed.fsdp import FullyShardedDataParallel

        flats = [m._flat_param for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
        fsdp1 = [
            (flat, int(flat._unpadded_unsharded_size.numel()) * flat.element_size())
            for flat in flats
            if flat is not None and hasattr(flat, "_full_param_padded")
        ]
        if fsdp1:
            return lambda: sum(size for flat, size in fsdp1 if flat._full_param_padded.untyped_storage().size() > 0)
        from torch.distributed.fsdp import FSDPModule

        states = [m._get_fsdp_state() for m in base.modules() if isinstance(m, FSDPModule)]
        groups = {id(g): g for state in states for g in state._fsdp_param_groups}
        fsdp2 = [(fp, _whole_bytes(fp, group)) for group in groups.values() for fp in group.fsdp_params]
        if fsdp2:
            from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

            return lambda: sum(size for fp, size in fsdp2 if fp.sharded_state != ShardedState.SHARDED)
    except (AttributeError, ImportError):  # another release's internals: no reading
        return None
    return None


def watch_held(model: Any, sample: Callable[[], int]) -> tuple[dict[str, Any], Callable[[], None]]:
    """Sample `sample()` before the training forward of every module with parameters of its own; returns the record
    (the largest sample, `max`, or why sampling stopped, `failed`) and a function that removes the hooks. A 70B
    Llama's forward: about 23 ms of flag reads on CPU."""
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
