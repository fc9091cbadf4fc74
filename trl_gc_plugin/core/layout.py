"""`Layout`: how each checkpointed block of a model runs, the one per-block description the planner writes,
`ckpt.apply` applies and `ckpt.layout_of` reads back. Plain data (no torch)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

Kind = Literal["none", "full", "selective", "lean", "offload"]
"""`selective` keeps matmul and attention outputs (`policies.selective_policy`), `lean` less the widening matmuls,
`offload` keeps the inputs in pinned host memory."""
SELECTIVE: frozenset[str] = frozenset({"selective", "lean"})


@dataclass(frozen=True)
class Layout:
    """One `Kind` per block (the model's `GradientCheckpointingLayer`s, in module order)."""

    kinds: tuple[Kind, ...]

    @classmethod
    def uniform(cls, kind: Kind, blocks: int) -> Layout:
        return cls((kind,) * blocks)

    @classmethod
    def from_pattern(cls, pattern: tuple[bool, ...], kind: Kind = "full") -> Layout:
        """The checkpointed blocks of `pattern` run `kind`, the others nothing."""
        return cls(tuple(kind if on else "none" for on in pattern))

    def __len__(self) -> int:
        return len(self.kinds)

    @property
    def pattern(self) -> tuple[bool, ...]:
        """Per block, whether it is checkpointed (its `gradient_checkpointing` flag)."""
        return tuple(k != "none" for k in self.kinds)

    @property
    def selective(self) -> tuple[bool, ...]:
        return tuple(k in SELECTIVE for k in self.kinds)

    @property
    def lean(self) -> tuple[bool, ...]:
        return tuple(k == "lean" for k in self.kinds)

    @property
    def offload(self) -> tuple[bool, ...]:
        return tuple(k == "offload" for k in self.kinds)

    @property
    def checkpointed(self) -> int:
        return sum(self.pattern)

    @property
    def uniform_kind(self) -> Kind | None:
        """The one kind every checkpointed block runs, or None (mixed, or nothing checkpointed)."""
        kinds = {k for k in self.kinds if k != "none"}
        return kinds.pop() if len(kinds) == 1 else None

    @property
    def every_n(self) -> int | None:
        """n when the checkpointed blocks are transformers' `every_n_layers=n` (block `i` when `i % n == 0`) and run one
        kind; else None."""
        if self.uniform_kind is None:
            return None
        return next((n for n in range(1, len(self) + 1) if self.pattern == every_n_pattern(len(self), n)), None)

    def count(self) -> Counter[str]:
        return Counter(self.kinds)


def every_n_pattern(blocks: int, n: int) -> tuple[bool, ...]:
    """transformers' `every_n_layers` (5.16+): block `i` checkpoints when `i % n == 0`."""
    return tuple(i % max(int(n), 1) == 0 for i in range(blocks))
