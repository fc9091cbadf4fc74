"""Throughput planning on CPU (issue 22): at an equal effective batch, the tokens per second of every (micro-batch,
plan) pair that fits the budget, against the pair `throughput.rank` picks; and the fit of the per-micro-step constant.

Method: the Llama-shaped CPU model of `planner_mixed.py` (hidden 512, intermediate 1376, 8 layers, 8 heads,
vocabulary 8000) at 256 tokens per row, float32, SDPA, one intra-op thread; an effective batch of 8 rows per optimizer
step (micro-batch 1, 2, 4 or 8 with accumulation 8, 4, 2, 1); the budget is the predicted peak of no checkpointing at
micro-batch 2, so micro-batches 4 and 8 need checkpointing. Pairs: at each micro-batch, no checkpointing where it fits,
the planner's pick and full checkpointing. One optimizer step (the accumulation's forwards and backwards and an SGD
step with learning rate 0) per pair and round, pairs interleaved, the order reversed every round; main-thread CPU
time, medians. The per-micro-step constant is fitted by least squares on every pair's time:
`t = a x accumulation + b x accumulation x forward x (3 + recompute)`, constant = a / b.

    .venv-tf5/bin/python benchmarks/throughput.py [--rounds 3]

Writes benchmarks/results/throughput.json (and throughput.png when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPE = {"hidden": 512, "intermediate": 1376, "layers": 8, "heads": 8, "vocab": 8000, "seq": 256}
EFFECTIVE = 8


def build():
    """`planner_mixed.py`'s model at this benchmark's sequence length."""
    import planner_mixed

    planner_mixed.SHAPE["seq"] = SHAPE["seq"]
    return planner_mixed.build()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    import torch
    import transformers

    from trl_gc_plugin.planning import memory, planner, throughput

    torch.set_num_threads(1)
    model = build()
    estimates = {mb: memory.estimate(model, mb, SHAPE["seq"]) for mb in throughput.micro_batches(EFFECTIVE)}
    budget = planner.predict_peak(estimates[2], (False,) * SHAPE["layers"])[0]
    ranked = throughput.rank(estimates.__getitem__, EFFECTIVE, budget, allow_selective=True, allow_offload=False)
    pick = ranked[0]
    arms = {}
    for mb, est in estimates.items():
        table = {c.name: c for c in planner.candidates(est, allow_selective=True, allow_offload=False)}
        chosen = planner.plan(est, budget, allow_selective=True, allow_offload=False).chosen
        for c in (table["none"], chosen, table["full"]):
            if c is not None and c.peak_bytes <= budget:
                arms[f"{mb}x{EFFECTIVE // mb} {c.name}"] = (mb, c)
    ids = torch.randint(SHAPE["vocab"], (EFFECTIVE, SHAPE["seq"]), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(mb: int) -> float:
        cpu = time.thread_time()
        for chunk in ids.split(mb):
            model(input_ids=chunk, labels=chunk).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.thread_time() - cpu

    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for name in names:  # warm-up
        planner.apply_plan(model, arms[name][1], use_reentrant=False)
        step(arms[name][0])
    for r in range(ns.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            mb, c = arms[name]
            planner.apply_plan(model, c, use_reentrant=False)
            times[name].append(step(mb))
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names), flush=True)
    tokens = EFFECTIVE * SHAPE["seq"]
    measured = {n: tokens / statistics.median(v) for n, v in times.items()}
    best = max(measured.values())
    pick_name = f"{pick.micro_batch}x{pick.accumulation} {pick.plan.name}"
    # the per-micro-step constant: least squares of t = a * ga + b * ga * forward * (3 + recompute)
    rows = []
    for name, (mb, c) in arms.items():
        ga = EFFECTIVE // mb
        rows.append((ga, ga * planner.forward_cost(estimates[mb], planner.BALANCE["cpu"]) * (3 + c.recompute),
                     statistics.median(times[name])))
    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    det = sxx * syy - sxy * sxy
    a, b = (sxt * syy - syt * sxy) / det, (syt * sxx - sxt * sxy) / det
    result = {
        "shape": SHAPE, "effective_batch": EFFECTIVE, "budget": budget, "rounds": ns.rounds,
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "ranked": [o.to_dict() | {"summary": o.summary()} for o in ranked],
        "pick": pick_name,
        "pick_in_measured": pick_name in measured,
        "measured_tokens_per_s": {n: round(v, 1) for n, v in measured.items()},
        "peak_predicted": {n: c.peak_bytes for n, (_, c) in arms.items()},
        "pick_vs_best": round(measured.get(pick_name, 0.0) / best, 4),
        "best": max(measured, key=measured.get),
        "spread": {n: round((max(v) - min(v)) / statistics.median(v), 3) for n, v in times.items()},
        "fit": {"a_s": a, "b_s_per_flop_eq": b, "microstep_overhead_flop_eq": a / b if b else None},
        "constant_used": throughput.MICROSTEP_OVERHEAD["cpu"],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, (_, c) in arms.items():
            ax.scatter(c.peak_bytes / 2**20, measured[name], color="C3" if name == pick_name else "C0")
            ax.annotate(name, (c.peak_bytes / 2**20, measured[name]), fontsize=7)
        ax.axvline(budget / 2**20, color="grey", linestyle="--")
        ax.set_xlabel("predicted peak (MiB)")
        ax.set_ylabel("tokens / s (measured)")
        ax.set_title(f"effective batch {EFFECTIVE} x {SHAPE['seq']}: pick in red")
        fig.tight_layout()
        fig.savefig(RESULTS / "throughput.png", dpi=120)
    except ImportError:
        pass
    print(json.dumps({k: result[k] for k in ("pick", "best", "pick_vs_best", "measured_tokens_per_s", "fit")},
                     indent=2))


if __name__ == "__main__":
    main()
