"""What sharded training holds whole at once, measured on the live model: the test side of the plan's
gathered-parameter term (`runtime_plan.gathered_parameter_bytes`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fsdp2_whole(p: Any) -> int:
    """FSDP2 registers a parameter as a DTensor while it is sharded and as a plain tensor while it is whole."""
    from torch.distributed.tensor import DTensor

    return 0 if isinstance(p, DTensor) else p.numel() * p.element_size()


def zero3_whole(p: Any) -> int:
    """DeepSpeed ZeRO-3 marks a parameter gathered (or being gathered) by its `ds_status`."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return p.ds_numel * p.element_size() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE else 0


def watch(model: Any, whole: Callable[[Any], int]) -> tuple[dict[str, Any], Callable[[], None]]:
    """Record, at the start of every module's forward in training (recomputed ones too), the bytes of the model's
    parameters held whole then; the largest and where it was. Hooks registered after the sharding's own (FSDP2
    prepends its pre-forward hook; register after DeepSpeed built its engine), so each module's own parameters are
    already gathered when it is sampled. Returns the record (`max` bytes, `at` which module, the parameters `whole`
    then) and a function that removes the hooks."""
    record: dict[str, Any] = {"max": 0, "at": None, "whole": []}

    def sample(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            if module.training:  # the parameters as registered now: FSDP2 swaps sharded and whole ones
                sizes = {n: whole(p) for n, p in model.named_parameters()}
                held = sum(sizes.values())
                if held > record["max"]:
                    record.update(max=held, at=name, whole=sorted(n for n, size in sizes.items() if size))

        return hook

    handles = [m.register_forward_pre_hook(sample(n)) for n, m in model.named_modules()]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return record, remove
