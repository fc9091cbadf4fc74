"""Check a memory plan against the first real training step.

The plan (`planner.plan` on `memory.estimate`) is a prediction. The first training forward runs anyway, so it is
measured while it runs (`memory.meter`: saved-tensor hooks that count the bytes autograd keeps, each storage once,
per block and outside the blocks; bytes are counted, no tensor is kept beyond the forward) and compared with what
the estimate predicts for the checkpointing that really ran and the batch shape it really had. A prediction off by
more than `TOLERANCE` is reported (rule `memory-plan`, setting `memory_plan_check`); fix mode re-plans from the
measurement (`corrected`).

torch is imported inside the functions only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..core.layout import Layout
from ..model import ckpt
from .memory import ActivationEstimate, SavedBytes

TOLERANCE = 0.15
"""Largest relative difference between predicted and measured saved bytes that is not reported."""


@dataclass(frozen=True)
class Comparison:
    """Predicted against measured bytes kept for the backward pass in one training forward.

    Args:
        predicted (`int`): what the estimate predicts for the checkpointing that ran, at the batch shape that ran.
        measured (`int`): what the forward saved (`SavedBytes.total`).
        blocks_predicted (`int`), blocks_measured (`int`): the part kept by the blocks (and their keyword tensors).
        outside_predicted (`int`), outside_measured (`int`): the part saved outside the blocks (embeddings, head,
            loss).
        batch_shape (`tuple[int, int]`): rows x tokens of the forward.
        pattern (`tuple[bool, ...]`): per block, whether it ran checkpointed.
    """

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
        """measured / predicted (inf when nothing was predicted and something was saved)."""
        if self.predicted <= 0:
            return 1.0 if self.measured <= 0 else float("inf")
        return self.measured / self.predicted

    @property
    def off(self) -> bool:
        """Whether the prediction misses the measurement by more than `TOLERANCE` of the measurement."""
        return abs(self.measured - self.predicted) > TOLERANCE * max(self.measured, 1)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["batch_shape"] = list(self.batch_shape)
        data["pattern"] = [int(x) for x in self.pattern]
        data["ratio"] = round(self.ratio, 4) if self.ratio != float("inf") else None
        return data


def predicted_parts(est: ActivationEstimate, layout: Layout) -> tuple[int, int]:
    """(bytes the blocks keep, bytes saved outside them) predicted for `layout` (`ActivationEstimate.saved_bytes`, in
    two parts, so a mixed live model is predicted too)."""
    shared = est.shared if not all(layout.pattern) else 0
    return sum(est.kept(layout)) + shared, est.outside


def compare(est: ActivationEstimate, measured: SavedBytes, model: Any) -> Comparison | None:
    """The prediction of `est` (made at the forward's own batch shape) against what `measured` counted; None when
    they cannot be compared (another number of blocks)."""
    layout = ckpt.layout_of(model)
    if len(layout) != est.num_blocks or len(measured.saved) != est.num_blocks:
        return None
    blocks, outside = predicted_parts(est, layout)
    measured_blocks = sum(measured.saved) + sum(measured.selective) + measured.shared
    return Comparison(
        predicted=blocks + outside,
        measured=measured.total,
        blocks_predicted=blocks,
        blocks_measured=measured_blocks,
        outside_predicted=outside,
        outside_measured=measured.outside,
        batch_shape=(est.batch_size, est.seq_len),
        pattern=layout.pattern,
    )


def scaled(est: ActivationEstimate, batch_size: int, seq_len: int) -> ActivationEstimate:
    """`est` taken to another batch shape in proportion to its tokens: exact for what grows with the tokens (every
    activation with SDPA or flash attention), not for what grows with their square (eager attention's scores, a
    padding mask). A first, free prediction for the check; a miss is confirmed with a real estimate."""
    ratio = (batch_size * seq_len) / max(est.batch_size * est.seq_len, 1)
    return est.blocks_times(
        ratio,
        kwargs_bytes=round(est.kwargs_bytes * ratio),
        outside=round(est.outside * ratio),
        batch_size=batch_size,
        seq_len=seq_len,
        method=f"{est.method}, scaled from {est.batch_size} x {est.seq_len} tokens",
    )


def corrected(planned: ActivationEstimate, comparison: Comparison) -> ActivationEstimate:
    """`planned` (the estimate the plan was made from, possibly at a longer shape) scaled by what the first step
    measured: the blocks' bytes by the blocks' measured/predicted ratio, the outside bytes by theirs. What fix mode
    re-plans from."""

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
    """The warning when the parameters ZeRO-3 / FSDP held whole in the first training forward (`record`, from
    `sharding.watch_held`) exceed what the plan counted (`predicted`, `ActivationEstimate.gathered_bytes`) by more
    than `TOLERANCE`, or when they could not be read; None otherwise. The plan counts the next block as prefetched,
    which a forward on CPU does not do, so a measurement below the prediction is the rule there."""
    if record["failed"] is not None:
        return (
            f"What the sharding held whole in the first step could not be read ({record['failed']}); the plan stands."
        )
    measured = int(record["max"])
    if measured <= predicted * (1 + TOLERANCE):
        return None
    from ..core.settings import format_bytes

    return (
        f"The memory plan counted {format_bytes(predicted)} ({predicted} bytes) of sharded parameters held whole while "
        f"a block or the loss head computes; the first training forward held {format_bytes(measured)} ({measured} "
        "bytes) at once. Something keeps more of the model gathered than the plan knows (a wrapping or a sharding "
        "setting it does not read, a hook that gathers parameters): the plan may not fit its budget; the plan stands."
    )
