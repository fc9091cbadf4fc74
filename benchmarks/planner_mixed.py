"""Per-block mixed plans against the uniform candidates (issue 22), on CPU: the share of full checkpointing's
recompute overhead each pick removes, `(t_full - t_plan) / (t_full - t_none)`, at budgets between the planner's own
predicted peaks of full and no checkpointing; the planned run's measured peak against the budget; gradients against
full checkpointing; and the time to plan a 70B layout.

Method: a Llama-shaped model (hidden 512, intermediate 1376, 8 layers, 8 heads, vocabulary 8000; batch 2 x 512
tokens; float32, SDPA) on one intra-op thread. Budgets at 50% (midway), 60% and 70% of the way from full's predicted
peak to none's. For each budget the planner is asked three times: with the per-block candidate (`planner.plan`),
with it but without the lean selective option (the estimate's `lean` removed: the planner before it), and without it
(the uniform candidates of `planner.candidates`, `selective-lean` among them). Every distinct pick plus none and full
runs in one process, switched with `apply_plan`, interleaved step by step (order reversed every round); main-thread
CPU time, medians over the rounds (`share_by_round`: the share in each round, its quartiles). Peaks: the tensors one
forward and backward creates (`memory.live_bytes`).

    .venv-tf5/bin/python benchmarks/planner_mixed.py [--rounds 7] [--seq 512]

Writes benchmarks/results/planner_mixed.json (planner_mixed_s256.json for `--seq 256`).

On a GPU (`--device cuda`): bfloat16, the cost model's CUDA constants, wall time around a synchronised step, the
same peaks (the tensors the step creates); `--shape` overrides the model, e.g. the issue's 7B-shaped blocks:

    python benchmarks/planner_mixed.py --device cuda --skip-70b --rounds 5 \
        --shape '{"hidden": 4096, "intermediate": 11008, "heads": 32, "layers": 4, "vocab": 32000, "batch": 1, "seq": 4096}'

writes results/planner_mixed_cuda.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPE = {"hidden": 512, "intermediate": 1376, "layers": 8, "heads": 8, "vocab": 8000, "batch": 2, "seq": 512}
FRACTIONS = (0.5, 0.6, 0.7)
DEVICE = {"name": "cpu"}


def build():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    s = SHAPE
    config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["heads"], vocab_size=s["vocab"],
                         max_position_embeddings=s["seq"], use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    if DEVICE["name"] == "cuda":
        model = model.to(device="cuda", dtype=torch.bfloat16)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(s["vocab"], (s["batch"], s["seq"]), generator=torch.Generator().manual_seed(1))
    ids = ids.to(DEVICE["name"])
    return model, {"input_ids": ids, "labels": ids}


def picks(est) -> tuple[dict, dict]:
    """Per budget: the pick with the per-block candidate, with it but without the lean option (the planner before
    lean selective), and with the uniform candidates only; and every distinct candidate to run, by key."""
    import dataclasses

    from trl_gc_plugin.planning import planner

    device = DEVICE["name"]
    constants = {"balance": planner.BALANCE[device], "op_overhead": planner.OP_OVERHEAD[device]}
    table = planner.candidates(est, allow_selective=True, allow_offload=False, **constants)
    by = {c.name: c for c in table}
    full, none = by["full"].peak_bytes, by["none"].peak_bytes
    arms = {"none": by["none"], "full": by["full"]}
    no_lean = dataclasses.replace(est, lean=(), lean_matmul_flops=())
    cases = {}

    def key_of(c, label: str, f: float) -> str:
        for key, arm in arms.items():
            if arm.layout == c.layout:
                return key
        return c.name if c.name != "mixed" else f"mixed@{f}" + ("" if label == "per_block" else "-no-lean")

    for f in FRACTIONS:
        budget = round(full + f * (none - full))
        uniform = next(c for c in table if c.allowed and c.peak_bytes <= budget)
        start = time.perf_counter()
        chosen = planner.plan(est, budget, allow_selective=True, allow_offload=False, device=device).chosen
        planning = time.perf_counter() - start
        before = planner.plan(no_lean, budget, allow_selective=True, allow_offload=False, device=device).chosen
        keys = {}
        for label, c in (("uniform", uniform), ("per_block_no_lean", before), ("per_block", chosen)):
            key = key_of(c, label, f)
            arms[key] = c
            keys[label] = key
        cases[str(f)] = {"budget": budget, **keys, "per_block_summary": chosen.summary(),
                         "per_block_no_lean_summary": before.summary(), "planning_s": planning,
                         "predicted": {k: {"recompute": round(arms[v].recompute, 4), "peak": arms[v].peak_bytes}
                                       for k, v in keys.items()}}
    return cases, arms


def run(rounds: int) -> dict:
    import torch

    from trl_gc_plugin.planning import memory, planner

    cuda = DEVICE["name"] == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    model, batch = build()
    est = memory.estimate(model, SHAPE["batch"], SHAPE["seq"])
    cases, arms = picks(est)
    names = list(arms)

    def grads() -> dict:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    planner.apply_plan(model, arms["full"], use_reentrant=False)
    reference = grads()
    peaks, exact = {}, {}
    for name in names:
        planner.apply_plan(model, arms[name], use_reentrant=False)
        got = grads()
        exact[name] = all(torch.equal(got[k], reference[k]) for k in reference)
        model.zero_grad(set_to_none=True)
        with memory.live_bytes() as live:
            model(**batch).loss.backward()
        peaks[name] = live.peak
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # steps cost the same, the weights stay put

    def step() -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter() if cuda else time.thread_time()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() if cuda else time.thread_time()) - start

    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up
        planner.apply_plan(model, arms[name], use_reentrant=False)
        step()
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            planner.apply_plan(model, arms[name], use_reentrant=False)
            times[name].append(step())
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names), flush=True)
    median = {n: statistics.median(v) for n, v in times.items()}
    t_full, t_none = median["full"], median["none"]
    for case in cases.values():
        case["measured"] = {}
        for label in ("uniform", "per_block_no_lean", "per_block"):
            name = case[label]
            steps = zip(times["full"], times[name], times["none"], strict=True)
            rounds_share = sorted((f - p) / (f - n) for f, p, n in steps)
            quartiles = statistics.quantiles(rounds_share, n=4) if len(rounds_share) > 1 else rounds_share * 3
            case["measured"][label] = {
                "name": name,
                "median_s": round(median[name], 4),
                "share_removed": round((t_full - median[name]) / (t_full - t_none), 3),
                # the same share in each round (its three steps ran side by side): median and quartiles, how far one
                # run's figure can be trusted on this machine
                "share_by_round": [round(q, 3) for q in quartiles],
                "peak": peaks[name],
                "under_budget": peaks[name] <= case["budget"],
                "gradients_equal_full": exact[name],
            }
    return {"cases": cases, "median_s": {n: round(v, 4) for n, v in median.items()},
            "spread": {n: round((max(v) - min(v)) / statistics.median(v), 3) for n, v in times.items()},
            "all_s": {n: [round(x, 4) for x in v] for n, v in times.items()}}


def plan_70b() -> dict:
    """Estimate and plan the llama3-70b layout (80 blocks, bf16, 1 x 4096 tokens) with per-block choices: seconds
    and the RSS peak growth (no tensor memory: two real bf16 blocks of this layout would be over 3 GiB)."""
    import resource

    from trl_gc_plugin.cli import plan as plan_cli
    from trl_gc_plugin.planning import memory, planner

    config, _ = plan_cli.load_config("llama3-70b")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    est = memory.estimate(config, 1, 4096, dtype="bf16", attn_implementation="sdpa")
    estimated = time.perf_counter() - start
    table = planner.candidates(est, allow_selective=True, allow_offload=False, grad_fraction=1 / 8)
    by = {c.name: c for c in table}
    budget = (by["full"].peak_bytes + by["none"].peak_bytes) // 2
    plans = []
    for _ in range(3):
        start = time.perf_counter()
        result = planner.plan(est, budget, allow_selective=True, allow_offload=False, grad_fraction=1 / 8)
        plans.append(time.perf_counter() - start)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"blocks": est.num_blocks, "estimate_s": round(estimated, 3), "plan_s": [round(t, 3) for t in plans],
            "budget": budget, "pick": result.chosen.summary() if result.chosen else None,
            "rss_peak_growth_bytes": grown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq", type=int, default=SHAPE["seq"], help="tokens per row (512; 256 was run too)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default=None, help="JSON overrides of the model shape (keys of SHAPE)")
    parser.add_argument("--skip-70b", action="store_true", help="do not time planning the 70B layout")
    parser.add_argument("--out", default=None, help="results file name under results/")
    ns = parser.parse_args()
    SHAPE["seq"] = ns.seq
    SHAPE.update(json.loads(ns.shape or "{}"))
    DEVICE["name"] = ns.device
    import torch
    import transformers

    result = {"shape": SHAPE, "python": platform.python_version(), "torch": torch.__version__,
              "transformers": transformers.__version__, "device": ns.device, "rounds": ns.rounds,
              "threads": 1 if ns.device == "cpu" else None}
    if ns.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    if not ns.skip_70b:
        result["plan_70b"] = plan_70b()
        print(json.dumps(result["plan_70b"]), flush=True)
    result.update(run(ns.rounds))
    RESULTS.mkdir(exist_ok=True)
    name = ns.out or ("planner_mixed_cuda.json" if ns.device == "cuda" else
                      "planner_mixed.json" if SHAPE["seq"] == 512 else f"planner_mixed_s{SHAPE['seq']}.json")
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["cases"], indent=2))


if __name__ == "__main__":
    main()
