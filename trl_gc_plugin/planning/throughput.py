"""Throughput planning: which micro-batch, gradient accumulation and checkpointing plan train fastest at a given
effective batch and memory budget.

Users do not choose a batch and then a plan: they have a device and an effective batch (micro-batch x accumulation
per device). Whether "micro-batch 8 with full checkpointing" or "micro-batch 2 without, accumulation 4" is faster
depends on the model and the device. For every micro-batch that divides the effective batch, the memory planner
(`planner.plan`) picks the cheapest plan that fits at that micro-batch; each option's optimizer-step cost, in the cost
model's FLOP-equivalents, is

    accumulation x (MICROSTEP_OVERHEAD + forward x (3 + recompute))

(a forward, a backward of twice its cost, the recomputed share of the forward; a fixed cost per micro-step for
kernel launches, Python and the data step, which is what makes small micro-batches slow on a GPU). Options rank by
predicted tokens per second relative to the fastest. The plugin applies only the checkpointing plan; the batch advice is
printed (`trl-gc-plan --effective-batch`) and recorded, never forced.

torch and transformers are imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.decisions import Decision
from .memory import ActivationEstimate
from .planner import BALANCE, Candidate, forward_cost, plan

MICROSTEP_OVERHEAD = {"cpu": 7.0e9, "cuda": 1.2e13}
"""FLOP-equivalents one micro-step costs besides its FLOPs (launches, Python, the data step), by device. CPU: fitted
by least squares to `benchmarks/throughput.py`'s step times (micro-batches 1, 2, 4 of the CPU benchmark model at
256 tokens, with and without checkpointing: 7.03e9 with the cost model's CPU balance of 22, 68 ms a micro-step). CUDA: from the H100 figure of
`benchmarks/planner.py` (the benchmark model's step, 29 ms without checkpointing, is launch-bound: its FLOPs take about
1 ms), not fitted across micro-batches: no GPU was lent for it."""


@dataclass(frozen=True)
class Option:
    """One way to reach the effective batch.

    Args:
        micro_batch (`int`): rows per forward.
        accumulation (`int`): forwards per optimizer step.
        plan (`Candidate`, *optional*): the cheapest plan that fits at this micro-batch; None when nothing fits.
        cost (`float`): predicted cost of one optimizer step (FLOP-equivalents); infinite when nothing fits.
        relative_speed (`float`): predicted tokens per second relative to the fastest option (1.0); 0 when nothing
            fits.
    """

    micro_batch: int
    accumulation: int
    plan: Candidate | None
    cost: float
    relative_speed: float = 0.0

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def summary(self) -> str:
        what = self.plan.summary() if self.plan is not None else "nothing fits"
        return f"micro-batch {self.micro_batch} x accumulation {self.accumulation}, {what}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "cost": self.cost if self.fits else None,
            "relative_speed": round(self.relative_speed, 4),
        }


def micro_batches(effective_batch: int, largest: int | None = None) -> list[int]:
    """The micro-batches that divide `effective_batch` (rows per device per optimizer step), up to `largest`."""
    if not isinstance(effective_batch, int) or isinstance(effective_batch, bool) or effective_batch < 1:
        raise ValueError(f"the effective batch must be a positive number of rows, got {effective_batch!r}")
    top = effective_batch if largest is None else min(largest, effective_batch)
    return [m for m in range(1, top + 1) if effective_batch % m == 0]


def at_rows(est: ActivationEstimate, rows: int) -> ActivationEstimate:
    """`est` taken to `rows` rows of the same length: every figure that grows with the rows (activations, the loss
    head's buffers, the gradient buffers of a block's backward, FLOPs, bytes written) in proportion; the parameters'
    gradients and the number of ops stay. Free (no fake forward), so the run can rank micro-batches at the cost of
    arithmetic. Exact where a tensor has a batch dimension (eager attention's scores and a padding mask included);
    the rotary tables the blocks share are per sequence, not per row, and are scaled too: a few KiB per block, on the
    safe side for a larger micro-batch."""
    if rows == est.batch_size:
        return est
    k = rows / max(est.batch_size, 1)

    def times(values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(round(v * k) for v in values)

    return est.blocks_times(
        k,
        kwargs_bytes=round(est.kwargs_bytes * k),
        outside=round(est.outside * k),
        logits_bytes=round(est.logits_bytes * k),
        loss_buffer_bytes=round(est.loss_buffer_bytes * k),
        transient_bytes=round(est.transient_bytes * k),
        block_flops=times(est.block_flops),
        matmul_flops=times(est.matmul_flops),
        lean_matmul_flops=times(est.lean_matmul_flops),
        other_bytes=times(est.other_bytes),
        outside_flops=round(est.outside_flops * k),
        batch_size=rows,
        method=f"{est.method}, scaled from {est.batch_size} to {rows} rows",
    )


def rank(
    estimate_at: Callable[[int], ActivationEstimate],
    effective_batch: int,
    budget_bytes: int,
    *,
    allow_selective: bool,
    allow_offload: bool,
    device: str = "cpu",
    largest: int | None = None,
    grad_fraction: float = 1.0,
) -> list[Option]:
    """Every (micro-batch, accumulation, plan) for `effective_batch` rows, fastest first.

    Args:
        estimate_at: the activation estimate at a micro-batch (`lambda b: memory.estimate(model, b, seq_len)`).
        effective_batch (`int`): rows per device per optimizer step.
        budget_bytes (`int`): the memory budget (as `planner.plan`'s).
        allow_selective, allow_offload: as `planner.plan`'s.
        device (`str`): `cpu` or `cuda`: the cost constants.
        largest (`int`, *optional*): the largest micro-batch to consider.
        grad_fraction (`float`): as `planner.plan`'s.
    """
    kind = device if device in BALANCE else "cuda"
    balance, overhead = BALANCE[kind], MICROSTEP_OVERHEAD[kind]
    options = []
    for mb in micro_batches(effective_batch, largest):
        est = estimate_at(mb)
        result = plan(
            est,
            budget_bytes,
            allow_selective=allow_selective,
            allow_offload=allow_offload,
            device=kind,
            grad_fraction=grad_fraction,
        )
        steps = effective_batch // mb
        chosen = result.chosen
        cost = steps * (overhead + forward_cost(est, balance) * (3 + chosen.recompute)) if chosen else float("inf")
        options.append(Option(mb, steps, chosen, cost))
    best = min((o.cost for o in options), default=float("inf"))
    ranked = [
        Option(o.micro_batch, o.accumulation, o.plan, o.cost, best / o.cost if o.fits and best > 0 else 0.0)
        for o in options
    ]
    return sorted(ranked, key=lambda o: (-o.relative_speed, -o.micro_batch))


def advice_decision(
    estimate: ActivationEstimate,
    budget_bytes: int,
    per_device: Any,
    accumulation: Any,
    **rank_kwargs: Any,
) -> Decision | None:
    """The run's batch advice (rule `batch-advice`, info, never applied): every micro-batch that divides the effective
    batch per device (`per_device` x `accumulation`), ranked under the plan's budget from the plan's `estimate` scaled
    to each micro-batch's rows (`at_rows`: no new forward). `estimate.batch_size` may be a multiple of `per_device`
    (DPO's chosen and rejected rows): micro-batches count examples, as the batch size does. None where the batch size
    or the accumulation is not a positive integer, or the rows are not a multiple of the batch size (packed rows).

    Args:
        estimate (`ActivationEstimate`): what the plan was made from.
        budget_bytes (`int`): the plan's budget.
        per_device, accumulation: `per_device_train_batch_size` and `gradient_accumulation_steps`.
        **rank_kwargs: `allow_selective`, `allow_offload`, `device`, `grad_fraction`, as `rank`'s.
    """
    from ..core.rules import get_rule

    if not (_positive_int(per_device) and _positive_int(accumulation)) or estimate.batch_size % per_device:
        return None
    rows = estimate.batch_size // per_device
    effective = per_device * accumulation
    options = rank(lambda mb: at_rows(estimate, mb * rows), effective, budget_bytes, **rank_kwargs)
    current = next(o for o in options if o.micro_batch == per_device)
    best = options[0]
    if best.micro_batch == per_device:
        reason = (
            f"The batch as set, {_said(current)}, is predicted the fastest way to {effective} rows per device per "
            f"optimizer step under the budget ({len(options)} micro-batches ranked)."
        )
    else:
        reason = (
            f"Predicted faster at the same effective batch ({effective} rows per device): {_said(best)}, "
            + (
                f"{current.cost / best.cost:.2f}x the tokens per second of "
                if current.fits
                else "where nothing fits for "
            )
            + f"the batch as set, {_said(current)}. The plugin applies only the checkpointing plan: to take the "
            f"advice, set per_device_train_batch_size={best.micro_batch} and "
            f"gradient_accumulation_steps={best.accumulation} (a prediction of the cost model, not a measurement)."
        )
    after = {**_row(best), "ranking": [_row(o) for o in options]}
    return get_rule("batch-advice").decision("none", _row(current), after, "runtime", reason, "train")


def _said(o: Option) -> str:
    return f"micro-batch {o.micro_batch} x accumulation {o.accumulation} ({o.plan.summary() if o.plan else 'nothing fits'})"


def _row(o: Option) -> dict[str, Any]:
    return {
        "micro_batch": o.micro_batch,
        "accumulation": o.accumulation,
        "plan": o.plan.name if o.plan else None,
        "relative_speed": round(o.relative_speed, 4),
    }


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


__all__ = ["MICROSTEP_OVERHEAD", "Option", "advice_decision", "at_rows", "micro_batches", "rank"]
