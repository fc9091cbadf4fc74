"""Throughput planning: which micro-batch, gradient accumulation and checkpointing plan train fastest at a given
effective batch and memory budget. For every micro-batch that divides the effective batch, `planner.plan` picks a plan;
an optimizer step costs `accumulation x (MICROSTEP_OVERHEAD + forward x (3 + recompute))` FLOP-equivalents (a forward,
a backward of twice its cost, the recompute). The batch advice is printed and recorded, never applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.decisions import Decision
from .memory import ActivationEstimate
from .planner import BALANCE, Candidate, forward_cost, plan

MICROSTEP_OVERHEAD = {"cpu": 7.0e9, "cuda": 1.2e13}
"""FLOP-equivalents one micro-step costs besides its FLOPs (launches, Python, the data step). CPU: fitted to
`benchmarks/throughput.py`'s step times; CUDA: from the launch-bound H100 step of `benchmarks/planner.py`, not fitted
across micro-batches."""


@dataclass(frozen=True)
class Option:
    """One way to reach the effective batch: its plan (None when nothing fits), the predicted cost of an optimizer step
    (infinite when nothing fits) and tokens per second relative to the fastest option."""

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
    if not _positive_int(effective_batch):
        raise ValueError(f"the effective batch must be a positive number of rows, got {effective_batch!r}")
    top = effective_batch if largest is None else min(largest, effective_batch)
    return [m for m in range(1, top + 1) if effective_batch % m == 0]


def at_rows(est: ActivationEstimate, rows: int) -> ActivationEstimate:
    """`est` taken to `rows` rows of the same length, without a fake forward: what grows with the rows in proportion,
    the parameters' gradients and the number of ops as they are (the shared rotary tables, per sequence, are scaled
    too: a few KiB per block, on the safe side)."""
    if rows == est.batch_size:
        return est
    return est.blocks_times(
        rows / max(est.batch_size, 1),
        also=_PER_ROW,
        batch_size=rows,
        method=f"{est.method}, scaled from {est.batch_size} to {rows} rows",
    )


_PER_ROW = (
    "kwargs_bytes",
    "outside",
    "loss_buffer_bytes",
    "transient_bytes",
    "outside_flops",
    "block_flops",
    "matmul_flops",
    "lean_matmul_flops",
    "other_bytes",
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
    """Every (micro-batch up to `largest`, accumulation, plan) for `effective_batch` rows per device, fastest first;
    `estimate_at(micro_batch)` gives the estimate, the other arguments are `planner.plan`'s."""
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
    """The run's batch advice (rule `batch-advice`, never applied): the micro-batches of `per_device` x `accumulation`
    ranked from the plan's `estimate` (`at_rows`). Its rows may be a multiple of `per_device` (DPO's chosen and rejected
    rows): micro-batches count examples. None where the batch is not positive integers or the rows not a multiple."""
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
    what = o.plan.summary() if o.plan else "nothing fits"
    return f"micro-batch {o.micro_batch} x accumulation {o.accumulation} ({what})"


def _row(o: Option) -> dict[str, Any]:
    return {
        "micro_batch": o.micro_batch,
        "accumulation": o.accumulation,
        "plan": o.plan.name if o.plan else None,
        "relative_speed": round(o.relative_speed, 4),
    }


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
