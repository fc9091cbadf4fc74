"""Plan the cheapest checkpointing that fits an activation-memory budget (`plan`), and apply it to a live model.

Predicted peak (above weights and optimizer state): the largest of the loss head (everything saved plus two float32
`batch x seq x vocab` buffers), each block's backward (what blocks `0..i` keep, what block `i` rebuilds, the keyword
tensors, the gradients of blocks `i..L-1` and the head, one block's gradient buffers) and the end (every gradient).
It assumes the parameter gradients are allocated during the backward, as `zero_grad(set_to_none=True)` (the
Trainer's and torch's default) leaves them; with `set_to_none=False`, or after the first micro-step of gradient
accumulation, they already sit in memory: `grads_preallocated` then leaves them out of the activation peak.
Recompute cost: a block's matmul and attention FLOPs plus `balance` per byte its other ops write; selective recomputes
only the latter, plus `op_overhead` per aten op (its policy runs in Python). Both constants rank candidates (fitted
with `benchmarks/planner.py`); they do not promise a step time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..core.decisions import Decision
from ..core.layout import SELECTIVE, Kind, Layout
from ..core.units import format_bytes
from ..model import ckpt
from .memory import ActivationEstimate

# FLOP-equivalents per byte written by a memory-bound op, and per aten op run under the selective policy, by device.
# CPU balance: `benchmarks/fit_balance.py` (median of the measured selective/full ratios at 256-1024 tokens; the earlier
# 170 came from a loaded machine). CUDA: fitted to the H100 step times of `benchmarks/planner.py`.
BALANCE = {"cpu": 22.0, "cuda": 500.0}
OP_OVERHEAD = {"cpu": 1e6, "cuda": 3e9}


@dataclass(frozen=True)
class Candidate:
    """One way to checkpoint (`none`, `every-2`, `3-of-8`, `full`, `selective`, `selective-lean`, `offload`,
    `mixed`), with its predicted peak (and where: `loss head`, `block 3`, `end`) and recomputed share of the forward."""

    name: str
    layout: Layout
    saved_bytes: int
    peak_bytes: int
    peak_at: str
    recompute: float
    allowed: bool = True
    why_not: str = ""

    @property
    def offload(self) -> bool:
        return any(self.layout.offload)

    def summary(self) -> str:
        layout, uniform, count = self.layout, self.layout.uniform_kind, self.layout.count()
        if self.name == "none":
            return "none (no block checkpointed)"
        if uniform is None or (uniform != "full" and count["none"]):
            leaner = f", {count['lean']} lean selective" if count["lean"] else ""
            return (
                f"{self.name} ({count['none']} blocks not checkpointed, {count['selective']} selective{leaner}, "
                f"{count['full']} full)"
            )
        what = {
            "lean": "attention outputs and those of matmuls that do not widen kept",
            "selective": "matmul and attention outputs kept",
            "offload": "inputs offloaded to host memory",
        }
        if uniform in what:
            return f"{self.name} (every block, {what[uniform]})"
        return f"{self.name} ({layout.checkpointed} of {len(layout)} blocks)"

    def to_dict(self) -> dict[str, Any]:
        layout, mixed = self.layout, self.layout.uniform_kind is None
        return {
            "name": self.name,
            "pattern": [int(x) for x in layout.pattern],
            "every_n": layout.every_n,
            "selective": any(layout.selective),
            "offload": self.offload,
            "saved_bytes": self.saved_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_at": self.peak_at,
            "recompute": round(self.recompute, 4),
            "recompute_blocks": round(layout.checkpointed / len(layout), 4) if len(layout) else 0.0,
            "allowed": self.allowed,
            "why_not": self.why_not,
            "selective_blocks": [int(x) for x in layout.selective] if mixed and any(layout.selective) else [],
            "lean_blocks": [int(x) for x in layout.lean] if any(layout.lean) else [],
        }


@dataclass(frozen=True)
class Plan:
    """The planner's answer: `chosen` (None when nothing fits), every candidate cheapest first, `lowest` (the allowed
    one with the lowest peak: what fix mode falls back to) and what was estimated."""

    chosen: Candidate | None
    candidates: tuple[Candidate, ...]
    budget: int
    fits: bool
    lowest: Candidate
    estimate: dict[str, Any]

    def get(self, name: str) -> Candidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.name if self.chosen else None,
            "fits": self.fits,
            "budget_bytes": self.budget,
            "lowest": self.lowest.name,
            "estimate": dict(self.estimate),
            "candidates": [c.to_dict() for c in self.candidates],
        }


def spread(k: int, n: int) -> tuple[bool, ...]:
    """`k` of `n` blocks checkpointed, evenly spread, block 0 first: transformers' `every_n_layers=m` pattern
    (`i % m == 0`) whenever `k = ceil(n / m)` divides evenly."""
    return tuple((i * k) % n < k for i in range(n))


def gathered_bytes(blocks: list[int], head: int, held: int = 0) -> int:
    """The parameters ZeRO-3 or FSDP holds whole at once besides `held`: a block's and the next one's (prefetched), or
    the head's and the last block's (on CPU nothing is prefetched: measured, held plus one block)."""
    return held + (max(2 * max(blocks), head + blocks[-1]) if blocks else 0)


def zero3_gathered(gathered: int, blocks: list[int], total: int, window: int, persistent: int = 0) -> int:
    """`gathered` widened to what ZeRO-3 keeps for reuse (up to `window` bytes besides the block computing) and its
    persistent parameters; at most the whole model, `total`."""
    return min(total, max(gathered, max(blocks, default=0) + window) + persistent)


SHARDED_LAYOUTS = ("zero3", "fsdp1", "fsdp2", "fsdp1-shard-grad-op", "fsdp2-no-reshard")


def layout_gathered(est: ActivationEstimate, layout: str, zero3_window: int) -> int:
    """The parameters held whole under `layout` (one of `SHARDED_LAYOUTS`) for a full fine-tune planned from a config
    (gradient bytes are parameter bytes), as `sharding.gathered_parameter_bytes` reads them with accelerate's wrapping:
    FSDP1 keeps its root unit whole, FSDP2 the final norm and head's group (from the start when it holds tied input
    embeddings); without resharding after forward the loss head holds the whole model."""
    import torch

    blocks, head, embeddings = list(est.grad_bytes), est.head_grad_bytes, est.embedding_grad_bytes
    total = sum(blocks) + head + embeddings
    if layout == "zero3":
        itemsize = int(getattr(torch, est.dtype.removeprefix("torch.")).itemsize)
        return zero3_gathered(gathered_bytes(blocks, head), blocks, total, zero3_window * itemsize)
    if layout == "fsdp1":
        return gathered_bytes(blocks, 0, held=head + embeddings)
    if layout == "fsdp2":
        tied = embeddings == 0
        return gathered_bytes(blocks, 0, held=head) if tied else gathered_bytes(blocks, head)
    if layout in ("fsdp1-shard-grad-op", "fsdp2-no-reshard"):
        return total
    raise ValueError(f"unknown sharded layout {layout!r}: one of {', '.join(SHARDED_LAYOUTS)}")


def predict_peak(
    est: ActivationEstimate, layout: Layout, grads_preallocated: bool = False, grad_fraction: float = 1.0
) -> tuple[int, str, dict[str, int]]:
    """(Predicted peak, where, the bytes of every phase) for one forward and backward under `layout`."""
    kept = est.kept(layout)
    shared = est.shared if not all(layout.pattern) else 0
    saved = est.saved_bytes(layout)
    alive = est.kwargs_bytes - shared  # keyword tensors of the blocks not counted as saved are alive all the same
    scale = 0.0 if grads_preallocated else grad_fraction
    grads = [round(g * scale) for g in est.grad_bytes]
    head = round(est.head_grad_bytes * scale)
    phases = {"loss head": saved + alive + 2 * est.loss_buffer_bytes + est.gathered_bytes}
    below = sum(kept)
    grads_after = head
    for i in reversed(range(est.num_blocks)):
        grads_after += grads[i]
        kind = layout.kinds[i]
        rebuilt = 0 if kind == "none" else est.saved[i] - est.input_saved[i] - est.policy_bytes(i, kind)
        if kind == "offload":
            rebuilt += est.inputs[i]
        phases[f"block {i}"] = (
            below + rebuilt + est.kwargs_bytes + grads_after + est.transient_bytes + est.gathered_bytes
        )
        below -= kept[i]
    phases["end"] = grads_after + round(est.embedding_grad_bytes * scale)
    where = max(phases, key=lambda k: phases[k])
    return phases[where], where, phases


def recompute_cost(est: ActivationEstimate, layout: Layout, balance: float, op_overhead: float = 0.0) -> float:
    """Recomputed share of the forward cost under `layout`."""
    total = forward_cost(est, balance)
    again = sum(_block_cost(est, i, k, balance, op_overhead) for i, k in enumerate(layout.kinds) if k != "none")
    return again / total if total > 0 else 0.0


def forward_cost(est: ActivationEstimate, balance: float) -> float:
    """One forward at the estimate's batch, in the cost model's FLOP-equivalents."""
    return est.outside_flops + sum(f + balance * b for f, b in zip(est.block_flops, est.other_bytes, strict=True))


def _block_cost(est: ActivationEstimate, i: int, kind: Kind, balance: float, op_overhead: float) -> float:
    selective = kind in SELECTIVE
    lean = kind == "lean" and est.lean_matmul_flops
    kept = (est.lean_matmul_flops[i] if lean else est.matmul_flops[i]) if selective else 0
    return est.block_flops[i] - kept + balance * est.other_bytes[i] + (op_overhead * est.ops[i] if selective else 0.0)


def candidates(
    est: ActivationEstimate,
    *,
    allow_selective: bool,
    allow_offload: bool,
    balance: float | None = None,
    op_overhead: float | None = None,
    grads_preallocated: bool = False,
    grad_fraction: float = 1.0,
    offload_why_not: str = "needs an accelerator (save_on_cpu pins host memory; it fails on a CPU-only machine)",
) -> list[Candidate]:
    """Every uniform candidate for `est`, cheapest first (predicted recompute cost, then predicted peak)."""
    n = est.num_blocks
    balance = BALANCE["cpu"] if balance is None else balance
    op_overhead = OP_OVERHEAD["cpu"] if op_overhead is None else op_overhead
    shapes: list[tuple[str, Layout, str]] = [("none", Layout.uniform("none", n), "")]
    for k in range(1, n):
        layout = Layout.from_pattern(spread(k, n))
        shapes.append((f"every-{layout.every_n}" if layout.every_n else f"{k}-of-{n}", layout, ""))
    shapes.append(("full", Layout.uniform("full", n), ""))
    for name, kind in (("selective", "selective"), ("selective-lean", "lean")):
        if kind == "lean" and not est.has_lean:
            continue
        why = "needs use_reentrant=False (torch accepts context_fn only for non-reentrant checkpointing)"
        if allow_selective:
            where = est.unsafe(kind)
            why = (
                f"a block writes in place to an output this policy keeps ({where}): torch refuses the cached tensor "
                "at the first backward ('Tensor cached during selective activation checkpoint has been mutated')"
                if where
                else ""
            )
        shapes.append((name, Layout.uniform(kind, n), why))
    shapes.append(("offload", Layout.uniform("offload", n), "" if allow_offload else offload_why_not))
    model = (balance, op_overhead, grads_preallocated, grad_fraction)
    out = [_candidate(est, name, layout, model, why) for name, layout, why in shapes]
    return sorted(out, key=_cheapest_first)


def _candidate(
    est: ActivationEstimate, name: str, layout: Layout, model: tuple[float, float, bool, float], why_not: str = ""
) -> Candidate:
    """`model`: (balance, op_overhead, grads_preallocated, grad_fraction); `why_not` disallows it."""
    balance, op_overhead, grads_preallocated, grad_fraction = model
    peak, where, _ = predict_peak(est, layout, grads_preallocated, grad_fraction)
    cost = recompute_cost(est, layout, balance, op_overhead)
    return Candidate(name, layout, est.saved_bytes(layout), peak, where, cost, not why_not, why_not)


def _cheapest_first(c: Candidate) -> tuple[float, int]:
    """Predicted recompute, then peak; offload recomputes what full does and copies the inputs too: after full."""
    return (c.recompute + (1e-9 if c.offload else 0.0), c.peak_bytes)


KNAPSACK_UNITS = 4096
"""The knapsack rounds block sizes up to 1/4096 of the room: a mixed plan never counts on more than there is."""


def mixed_candidate(
    est: ActivationEstimate,
    budget_bytes: int,
    *,
    allow_selective: bool,
    balance: float,
    op_overhead: float,
    grads_preallocated: bool = False,
    grad_fraction: float = 1.0,
) -> Candidate | None:
    """A per-block plan for `budget_bytes` (none, full, selective or lean per block) with the least predicted
    recompute: a multiple-choice knapsack over the blocks' kept bytes in the room the loss head leaves, checked against
    the whole predicted peak; where a block's backward peaks higher, the room shrinks by the excess (at most 8 tries).
    None when it does not fit."""
    import numpy as np

    n = est.num_blocks
    if n == 0:
        return None
    options: tuple[Kind, ...] = ("none", "full", "selective", "lean")
    options = options[: (4 if est.has_lean else 3) if allow_selective else 2]
    options = tuple(k for k in options if not est.unsafe(k))
    kept = np.array([est.kept(Layout.uniform(k, n)) for k in options], dtype=np.float64).T  # a row per block
    cost = np.array(
        [[0.0 if k == "none" else _block_cost(est, i, k, balance, op_overhead) for k in options] for i in range(n)]
    )
    # the loss head besides the blocks (and the parameters ZeRO-3 / FSDP2 hold gathered there)
    fixed = est.outside + est.kwargs_bytes + 2 * est.loss_buffer_bytes + est.gathered_bytes
    room = budget_bytes - fixed
    for _ in range(8):
        if room <= 0:
            return None
        choice = _knapsack(kept, cost, room)
        if choice is None:
            return None
        layout = Layout(tuple(options[k] for k in choice))
        mixed = _candidate(est, "mixed", layout, (balance, op_overhead, grads_preallocated, grad_fraction))
        if mixed.peak_bytes <= budget_bytes:
            return mixed
        room -= mixed.peak_bytes - budget_bytes
    return None


def _knapsack(kept: Any, cost: Any, room: float) -> list[int] | None:
    """One option per block (a row of `kept` / `cost`) with the least total cost that fits `room`; None if none does."""
    import numpy as np

    units = KNAPSACK_UNITS
    weight = np.ceil(kept / (room / units)).astype(np.int64)
    inf = float("inf")
    best = np.zeros(units + 1)  # least cost of the blocks so far within each capacity
    picks = []
    for w_row, c_row in zip(weight, cost, strict=True):
        new = np.full(units + 1, inf)
        pick = np.zeros(units + 1, dtype=np.int8)
        for option, (w, c) in enumerate(zip(w_row, c_row, strict=True)):
            if w > units:
                continue
            shifted = np.full(units + 1, inf)
            shifted[w:] = best[: units + 1 - w] + c
            better = shifted < new
            new[better], pick[better] = shifted[better], option
        best = new
        picks.append(pick)
    if not np.isfinite(best[units]):
        return None
    choice, capacity = [], units
    for w_row, pick in zip(weight[::-1], picks[::-1], strict=True):
        option = int(pick[capacity])
        choice.append(option)
        capacity -= int(w_row[option])
    return choice[::-1]


def plan(
    estimate: ActivationEstimate,
    budget_bytes: int,
    *,
    allow_selective: bool,
    allow_offload: bool,
    device: str | None = None,
    balance: float | None = None,
    op_overhead: float | None = None,
    grads_preallocated: bool = False,
    grad_fraction: float = 1.0,
    offload_why_not: str = "",
) -> Plan:
    """The cheapest allowed candidate whose predicted peak fits `budget_bytes` (activation memory per device). `device`
    (`cpu`, or `cuda` for any accelerator; default `cuda` when offloading is allowed) picks the cost constants.
    `grads_preallocated`: the gradients already sit in memory; `grad_fraction`: their share on this device.
    """
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes < 1:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    kind = device or ("cuda" if allow_offload else "cpu")
    kind = kind if kind in BALANCE else "cuda"
    balance = BALANCE[kind] if balance is None else balance
    op_overhead = OP_OVERHEAD[kind] if op_overhead is None else op_overhead
    common = {
        "allow_selective": allow_selective,
        "balance": balance,
        "op_overhead": op_overhead,
        "grads_preallocated": grads_preallocated,
        "grad_fraction": grad_fraction,
    }
    why = {"offload_why_not": offload_why_not} if offload_why_not else {}
    table = candidates(estimate, allow_offload=allow_offload, **why, **common)
    mixed = mixed_candidate(estimate, budget_bytes, **common)
    if mixed is not None and mixed.layout not in {c.layout for c in table}:
        table = sorted([*table, mixed], key=_cheapest_first)
    allowed = [c for c in table if c.allowed]
    chosen = next((c for c in allowed if c.peak_bytes <= budget_bytes), None)
    lowest = min(allowed, key=lambda c: (c.peak_bytes, c.recompute))
    summary = {
        "batch_size": estimate.batch_size,
        "seq_len": estimate.seq_len,
        "dtype": estimate.dtype,
        "attn_implementation": estimate.attn_implementation,
        "method": estimate.method,
        "blocks": estimate.num_blocks,
        "device": kind,
        "balance": balance,
        "op_overhead": op_overhead,
        "grads_preallocated": grads_preallocated,
        "grad_fraction": grad_fraction,
        "gathered_bytes": estimate.gathered_bytes,
    }
    return Plan(chosen, tuple(table), budget_bytes, chosen is not None, lowest, summary)


def _cost(c: Candidate) -> str:
    if c.name == "none":
        return "recomputes nothing"
    blocks = f"{c.layout.checkpointed} of {len(c.layout)} blocks"
    count, uniform = c.layout.count(), c.layout.uniform_kind
    kind = {"selective": "their elementwise ops", "lean": "their elementwise ops and widening matmuls"}.get(
        uniform, "them"
    )
    if uniform is None:
        kind = "them (the selective ones only their elementwise ops"
        kind += ", the lean ones their widening matmuls too)" if count["lean"] else ")"
    return f"recomputes {kind} ({blocks}, about {c.recompute:.0%} of the forward cost)"


def plan_decisions(plan: Plan, mode: str) -> list[Decision]:
    """The plan as one `Decision` of the rule `memory-plan` (in `mode`, replacing full checkpointing): `default` (a plan
    fits), `error` (nothing fits, strict) or `warn` (nothing fits: the lowest-memory plan is applied)."""
    from ..core.rules import get_rule

    rule = get_rule("memory-plan")
    budget = format_bytes(plan.budget)
    after = {"plan": None, **plan.to_dict()}
    fitting = [c for c in plan.candidates if c.allowed and c.peak_bytes <= plan.budget]
    if plan.chosen is not None:
        c = plan.chosen
        after["plan"] = c.name
        faster = [x for x in plan.candidates if x.allowed and x.recompute < c.recompute]
        why = (
            f"the cheapest of {len(fitting)} allowed candidates that fit"
            if not faster
            else f"the cheapest that fits: {faster[-1].name} would need {format_bytes(faster[-1].peak_bytes)}"
        )
        reason = (
            f"memory plan {c.summary()}: predicted peak {format_bytes(c.peak_bytes)} of the {budget} budget, "
            f"{_cost(c)}; {why}. Predicted from the bytes autograd saves in one forward of the model's layout "
            f"({plan.estimate.get('method')}, batch {plan.estimate.get('batch_size')} x "
            f"{plan.estimate.get('seq_len')} tokens); the gradients equal full checkpointing's."
        )
        return [rule.decision("default", "full", after, "runtime", reason, "train")]
    low = plan.lowest
    after["plan"] = low.name
    need = (
        f"no checkpointing plan fits the {budget} memory budget: the lowest-memory one, {low.summary()}, needs "
        f"{format_bytes(low.peak_bytes)} (predicted, at {low.peak_at}) at batch {plan.estimate.get('batch_size')} x "
        f"{plan.estimate.get('seq_len')} tokens"
    )
    if mode == "strict":
        reason = (
            f"{need}. Raise memory_budget to at least {format_bytes(low.peak_bytes)}, or lower the per-device batch "
            "size or the sequence length, or use fix mode to train with the lowest-memory plan anyway."
        )
        return [rule.decision("error", "full", after, "runtime", reason, "train")]
    reason = f"{need}. Training with it anyway ({mode} mode); it may run out of memory."
    return [replace(rule.decision("warn", "full", after, "runtime", reason, "train"), applied=True)]


def apply_plan(model: Any, candidate: Candidate, use_reentrant: bool) -> None:
    """Apply `candidate.layout` to the live model's blocks (`ckpt.apply`), never through the training arguments (a
    callable there breaks `to_json_string()`); transformers' own layer keys never reach torch's checkpoint."""
    keywords = {"every_n_layers": None, "offload": None}
    ckpt.apply(model, ckpt.Spec(layout=candidate.layout, use_reentrant=use_reentrant, keywords=keywords))


# Under torch.compile, which of the two ways to fit a budget was faster on the CPU benchmark
# (benchmarks/vs_compile.py, results/vs_compile.json), by the budget's fraction of the way from full checkpointing's
# saved bytes to none's: "partitioner" (no checkpointing, AOTAutograd's min-cut partitioner under
# `torch._functorch.config.activation_memory_budget`) or "plan" (the plan's layout inside the compiled model).
# Measured (Llama-shaped, 2 layers, hidden 256, 2 x 256 tokens, torch 2.13 CPU, min of 30 rounds): 130 vs 136 ms
# (the plan there is full checkpointing), 128 vs 130 ms, 116 vs 120 ms, both fitting; margins of 2-4%, inside the
# noise of that busy machine (two arms of the same layout differed by 9%): the partitioner is not slower, and it fits
# any fraction where a plan of two blocks has few steps.
COMPILED_FASTER: tuple[tuple[float, str], ...] = ((0.25, "partitioner"), (0.5, "partitioner"), (0.75, "partitioner"))


@dataclass(frozen=True)
class CompiledChoice:
    """Under torch.compile: `way` is `plan` (the plan's layout, compiled) or `partitioner` (checkpointing off, torch's
    `activation_memory_budget` set to `fraction`); `why` says which measurement or condition decided."""

    way: str
    fraction: float | None
    why: str


def compiled_choice(plan: Plan) -> CompiledChoice:
    """Choose between the plan's layout and the partitioner's memory budget for a compiled model. The partitioner's
    budget is a fraction of what the compiled graph would save without checkpointing; it is set to the budget's room
    for saved activations over what no checkpointing is predicted to save in eager mode (compiled graphs saved less
    on the benchmark: the fraction errs towards less memory)."""
    none = plan.get("none")
    full = plan.get("full")
    chosen = plan.chosen
    if chosen is None:
        return CompiledChoice("plan", None, "no plan fits the budget: the lowest-memory plan, compiled")
    if chosen.name == "none":
        return CompiledChoice("plan", None, "no checkpointing fits the budget: nothing to recompute")
    room = plan.budget - (none.peak_bytes - none.saved_bytes)
    fraction = round(room / none.saved_bytes, 3) if none.saved_bytes > 0 else 0.0
    if fraction <= 0.0:
        return CompiledChoice(
            "plan",
            None,
            "the budget leaves no room for saved activations without checkpointing: the partitioner "
            "would recompute everything",
        )
    span = none.peak_bytes - full.peak_bytes
    way_along = (plan.budget - full.peak_bytes) / span if span > 0 else 1.0
    nearest, way = min(COMPILED_FASTER, key=lambda fw: abs(fw[0] - way_along))
    why = (
        f"the budget is {way_along:.0%} of the way from full checkpointing's predicted peak to none's; on the CPU "
        f"benchmark (benchmarks/vs_compile.py) at {nearest:.0%} of the way "
        + ("the partitioner's activation_memory_budget" if way == "partitioner" else "the plan's layout, compiled,")
        + " gave the faster step at no more saved bytes"
    )
    return CompiledChoice(way, min(fraction, 1.0) if way == "partitioner" else None, why)
