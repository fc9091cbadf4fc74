"""Fit the cost model's `BALANCE` (FLOP-equivalents per byte a memory-bound op writes) for this CPU: time no
checkpointing, full and selective checkpointing on the per-block benchmark model, interleaved, and solve the cost
model for the value that makes its selective/full recompute ratio the measured one.

Cost model (`planner._block_cost`): full recomputes `matmul + B * other_bytes (+ the rest of the block's FLOPs)`,
selective `B * other_bytes + OP_OVERHEAD * ops (+ the FLOPs selective does not keep)`. With the measured ratio
`r = (t_selective - t_none) / (t_full - t_none)` and the estimate's per-block counts, `B` is the solution of
`selective_cost(B) = r * full_cost(B)` (linear in `B`).

Method: Llama hidden 512, intermediate 1376, 8 layers, 8 heads, vocabulary 8000, batch 2, float32, SDPA, one intra-op
thread, main-thread CPU time of one forward, backward and SGD step, rounds interleaved with the order reversed every
round, medians; at 256, 512 and 1024 tokens per row.

    .venv-tf5/bin/python benchmarks/fit_balance.py [--rounds 11] [--seqs 256 512 1024]

Writes benchmarks/results/fit_balance.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner_mixed  # the benchmark model

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("none", "full", "selective")


def fit(rounds: int, seq: int) -> dict:
    import torch

    from trl_gc_plugin.planning import memory, planner

    torch.set_num_threads(1)
    planner_mixed.SHAPE["seq"] = seq
    model, batch = planner_mixed.build()
    est = memory.estimate(model, planner_mixed.SHAPE["batch"], seq)
    table = {c.name: c for c in planner.candidates(est, allow_selective=True, allow_offload=False)}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(name: str) -> float:
        planner.apply_plan(model, table[name], use_reentrant=False)
        cpu = time.thread_time()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.thread_time() - cpu

    for name in ARMS:  # warm-up
        step(name)
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for r in range(rounds):
        for name in ARMS if r % 2 == 0 else ARMS[::-1]:
            times[name].append(step(name))
    median = {name: statistics.median(v) for name, v in times.items()}
    ratio = (median["selective"] - median["none"]) / (median["full"] - median["none"])
    # selective_cost(B) = r * full_cost(B), both summed over the blocks; each cost is a + B * ob
    ob = sum(est.other_bytes)
    full_a = sum(est.block_flops)
    sel_a = sum(f - m for f, m in zip(est.block_flops, est.matmul_flops, strict=True))
    sel_a += planner.OP_OVERHEAD["cpu"] * sum(est.ops)
    balance = (ratio * full_a - sel_a) / ((1 - ratio) * ob) if ratio < 1 else float("inf")
    return {"seq": seq, "median_s": {k: round(v, 4) for k, v in median.items()},
            "spread": {k: round((max(v) - min(v)) / statistics.median(v), 3) for k, v in times.items()},
            "selective_over_full_recompute": round(ratio, 3), "balance_fit": round(max(balance, 0.0), 1),
            "model_ratio_at_current_balance": round(
                (sel_a + planner.BALANCE["cpu"] * ob) / (full_a + planner.BALANCE["cpu"] * ob), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    ns = parser.parse_args()
    import torch

    from trl_gc_plugin.planning import planner

    result = {"python": platform.python_version(), "torch": torch.__version__, "threads": 1, "rounds": ns.rounds,
              "balance_used": planner.BALANCE["cpu"], "load_average_before": list(os.getloadavg()), "fits": []}
    for seq in ns.seqs:
        result["fits"].append(fit(ns.rounds, seq))
        print(json.dumps(result["fits"][-1]), flush=True)
    result["load_average_after"] = list(os.getloadavg())
    result["balance_median"] = statistics.median(f["balance_fit"] for f in result["fits"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fit_balance.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"balance_median": result["balance_median"]}))


if __name__ == "__main__":
    main()
