"""What sharded training holds whole at once, measured on the live model: the test side of the plan's
gathered-parameter term (`sharding.gathered_parameter_bytes`). Each `*_whole(model)` says, for what the sharding
holds now, the whole bytes by name (parameters, or FSDP1 units)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fsdp2_whole(model: Any) -> dict[str, int]:
    """FSDP2 registers a parameter as a DTensor while it is sharded and as a plain tensor while it is whole."""
    from torch.distributed.tensor import DTensor

    return {n: p.numel() * p.element_size() for n, p in model.named_parameters() if not isinstance(p, DTensor)}


def zero3_whole(model: Any) -> dict[str, int]:
    """DeepSpeed ZeRO-3 marks a parameter gathered (or being gathered) by its `ds_status`."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return {n: p.ds_numel * p.element_size() for n, p in model.named_parameters()
            if p.ds_status != ZeroParamStatus.NOT_AVAILABLE}


def fsdp1_whole(model: Any) -> dict[str, int]:
    """FSDP1 gathers a unit's flat parameter into its `_full_param_padded`, whose storage it frees when it reshards."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    held = {}
    for name, unit in model.named_modules():
        flat = unit._flat_param if isinstance(unit, FullyShardedDataParallel) else None
        padded = getattr(flat, "_full_param_padded", None)
        if padded is not None and padded.untyped_storage().size() > 0:
            held[name or "root"] = int(flat._unpadded_unsharded_size.numel()) * flat.element_size()
    return held


def watch(model: Any, whole: Callable[[Any], dict[str, int]]) -> tuple[dict[str, Any], Callable[[], None]]:
    """Record, at the start of every module's forward in training (recomputed ones too), the bytes `whole(model)`
    says are held whole then; the largest, where, and what. Hooks registered after the sharding's own (FSDP2 prepends
    its pre-forward hook; register after DeepSpeed built its engine and FSDP1 wrapped the model), so each module's own
    parameters are already gathered when it is sampled. Returns the record (`max` bytes, `at` which module, `whole`:
    the names held then) and a function that removes the hooks."""
    record: dict[str, Any] = {"max": 0, "at": None, "whole": []}

    def sample(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            if module.training:  # read as registered now: FSDP2 swaps sharded and whole parameters
                sizes = whole(model)
                if sum(sizes.values()) > record["max"]:
                    record.update(max=sum(sizes.values()), at=name, whole=sorted(sizes))

        return hook

    handles = [m.register_forward_pre_hook(sample(n)) for n, m in model.named_modules()]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return record, remove
