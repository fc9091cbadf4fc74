"""Check a memory plan against the first real training step: what `memory.meter` counted in that forward against what
the estimate predicts for the checkpointing and batch shape that ran; a miss beyond `TOLERANCE` is reported, and fix
mode re-plans from the measurement (`corrected`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..model import ckpt
from .memory import ActivationEstimate, SavedBytes

TOLERANCE = 0.15


@dataclass(frozen=True)
class Comparison:
    """Predicted against measured bytes kept for the backward pass in one training forward, in all, by the blocks
    (with their keyword tensors) and outside them."""

    predicted: int
    measured: int
    blocks_predicted: int
    blocks_measured: int
    outside_predicted: int
    outside_measured: int
    batch_shape: tuple[int, int]
    pattern: tuple[bool, ...]

    @property
    def ratio(self) -> float:
        if self.predicted <= 0:
            return 1.0 if self.measured <= 0 else float("inf")
        return self.measured / self.predicted

    @property
    def off(self) -> bool:
        return abs(self.measured - self.predicted) > TOLERANCE * max(self.measured, 1)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["batch_shape"] = list(self.batch_shape)
        data["pattern"] = [int(x) for x in self.pattern]
        data["ratio"] = round(self.ratio, 4) if self.ratio != float("inf") else None
        return data


def compare(est: ActivationEstimate, measured: SavedBytes, model: Any) -> Comparison | None:
    """The prediction of `est` (at the forward's batch shape) against `measured`; None for another number of blocks."""
    layout = ckpt.layout_of(model)
    if len(layout) != est.num_blocks or len(measured.saved) != est.num_blocks:
        return None
    predicted = est.saved_bytes(layout)
    return Comparison(
        predicted=predicted,
        measured=measured.total,
        blocks_predicted=predicted - est.outside,
        blocks_measured=sum(measured.saved) + sum(measured.selective) + measured.shared,
        outside_predicted=est.outside,
        outside_measured=measured.outside,
        batch_shape=(est.batch_size, est.seq_len),
        pattern=layout.pattern,
    )


def scaled(est: ActivationEstimate, batch_size: int, seq_len: int) -> ActivationEstimate:
    """`est` taken to another batch shape in proportion to its tokens (not exact for eager attention's `s x s` scores):
    a free first prediction; a miss is confirmed with a real estimate."""
    ratio = (batch_size * seq_len) / max(est.batch_size * est.seq_len, 1)
    return est.blocks_times(
        ratio,
        also=("kwargs_bytes", "outside"),
        batch_size=batch_size,
        seq_len=seq_len,
        method=f"{est.method}, scaled from {est.batch_size} x {est.seq_len} tokens",
    )


def corrected(planned: ActivationEstimate, comparison: Comparison) -> ActivationEstimate:
    """`planned` (the plan's estimate) with the blocks' and the outside bytes scaled by what the first step measured."""

    def ratio(measured: int, predicted: int) -> float:
        return measured / predicted if predicted > 0 else 1.0

    blocks = ratio(comparison.blocks_measured, comparison.blocks_predicted)
    outside = ratio(comparison.outside_measured, comparison.outside_predicted)
    tokens = (planned.batch_size * planned.seq_len) / max(comparison.batch_shape[0] * comparison.batch_shape[1], 1)
    outside_bytes = (
        round(planned.outside * outside)
        if comparison.outside_predicted > 0
        else round(comparison.outside_measured * tokens)
    )
    return planned.blocks_times(
        blocks,
        outside=outside_bytes,
        method=f"{planned.method}, corrected by the first step (blocks x{blocks:.2f}, outside x{outside:.2f})",
    )


def held_miss(predicted: int, record: dict[str, Any]) -> str | None:
    """The warning when the sharded parameters held whole in the first forward (`sharding.watch_held`'s `record`)
    exceed the plan's `gathered_bytes` by more than `TOLERANCE`, or could not be read; None otherwise."""
    if record["failed"] is not None:
        return (
            f"What the sharding held whole in the first step could not be read ({record['failed']}); the plan stands."
        )
    measured = int(record["max"])
    if measured <= predicted * (1 + TOLERANCE):
        return None
    from ..core.units import format_bytes

    return (
        f"The memory plan counted {format_bytes(predicted)} ({predicted} bytes) of sharded parameters held whole while "
        f"a block or the loss head computes; the first training forward held {format_bytes(measured)} ({measured} "
        "bytes) at once. Something keeps more of the model gathered than the plan knows (a wrapping or a sharding "
        "setting it does not read, a hook that gathers parameters): the plan may not fit its budget; the plan stands."
    )
