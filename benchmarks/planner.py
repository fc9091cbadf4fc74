"""The memory planner on the benchmark model (Llama hidden 512, 8 layers, 8 heads, vocab 8000, seq 512, batch 4, as
`benchmarks/modes.py`): predicted against measured activation peak for every candidate, step times, the planned run
at a budget midway between full checkpointing's and no checkpointing's peaks, gradient exactness, the frontier
plot, the plans for 7B/8B/70B layouts, the planner's own cost and the comparison with Korthikanti et al. 2022.

Method:
- Memory: each candidate in a fresh process (a process's peak RSS and the allocator's caches keep what an earlier
  candidate used). The model and AdamW are built and one warm-up step is taken (the optimizer state is allocated),
  then one measured forward and backward. Measured: the bytes autograd keeps (`memory.measure`), the peak of the
  tensors the step creates (`memory.live_bytes`, a dispatch mode over every op), and the device's own figure: on CPU
  the RSS peak above the RSS before the step (glibc told to `mmap` and return every block of 64 KiB or more,
  `MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=65536`, and the kernel's peak counter reset through
  `/proc/self/clear_refs`), on CUDA `torch.cuda.max_memory_allocated()` minus the memory allocated before the step.
  Predicted: `planner.predict_peak` on `memory.estimate` of the live model (fake tensors, no memory).
- Time: all timed candidates in one process, switched with `planner.apply_plan`, interleaved step by step (the
  order reversed every round) so that the load of this shared machine hits them alike; on CPU one intra-op thread
  and the main thread's CPU time (`time.thread_time`; the CPU autograd engine runs on the calling thread) beside
  the wall time; on CUDA wall time between synchronizations. Medians and minimums over the rounds.

    .venv-tf5/bin/python benchmarks/planner.py [--rounds 4] [--device cpu|cuda] [--skip-memory] [--skip-time]

Writes benchmarks/results/planner.json (planner_cuda.json on CUDA), planner.csv and planner.png.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results"
MiB = 2**20
SHAPE = {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 8, "intermediate": 512 * 8 // 3, "vocab": 8000, "seq": 512,
         "batch": 4}
TIMED = ("none", "every-4", "every-2", "6-of-8", "selective", "full")
LAYOUT_CASES = [
    ("llama-7b", 1, 4096, 1),
    ("llama-7b", 4, 4096, 1),
    ("llama-7b", 8, 2048, 1),
    ("llama3-8b", 1, 4096, 1),
    ("llama3-8b", 4, 4096, 1),
    ("llama3-8b", 8, 2048, 1),
    ("llama3-70b", 1, 4096, 8),
    ("llama3-70b", 2, 4096, 8),
    ("llama3-70b", 4, 8192, 8),
]
LAYOUT_BUDGETS = ("24GiB", "40GiB", "60GiB")


def build(device: str, dtype_name: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    s = SHAPE
    config = LlamaConfig(
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        vocab_size=s["vocab"],
        max_position_embeddings=s["seq"],
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, dtype_name))
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(s["vocab"], (s["batch"], s["seq"]), generator=torch.Generator().manual_seed(1)).to(device)
    return model, {"input_ids": ids, "labels": ids}


def table_for(model, allow_offload: bool):
    from trl_gc_plugin.planning import memory, planner

    est = memory.estimate(model, SHAPE["batch"], SHAPE["seq"])
    kind = "cuda" if allow_offload else "cpu"
    return est, planner.candidates(est, allow_selective=True, allow_offload=allow_offload,
                                   balance=planner.BALANCE[kind], op_overhead=planner.OP_OVERHEAD[kind])


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def memory_worker(name: str, device: str, dtype_name: str, out: str) -> None:
    import torch

    from trl_gc_plugin.planning import memory, planner

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model, batch = build(device, dtype_name)
    _, table = table_for(model, device == "cuda")
    candidate = next(c for c in table if c.name == name)
    planner.apply_plan(model, candidate, use_reentrant=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    saved = memory.measure(model, batch).total
    model.zero_grad(set_to_none=True)
    with memory.live_bytes() as live:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    gc.collect()
    result = {"name": name, "saved": saved, "live_peak": live.peak, "predicted_saved": candidate.saved_bytes,
              "predicted_peak": candidate.peak_bytes, "predicted_at": candidate.peak_at}
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(**batch).loss.backward()
        torch.cuda.synchronize()
        result["device_peak"] = torch.cuda.max_memory_allocated() - base
        result["device_metric"] = "torch.cuda.max_memory_allocated above the allocated before the step"
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        base = _status()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        loss = model(**batch).loss
        loss.backward()
        del loss
        result["device_peak"] = _status()["VmHWM"] - base
        result["device_metric"] = "RSS peak (VmHWM, reset) above the RSS before the step"
    Path(out).write_text(json.dumps(result))


def run_memory(ns: argparse.Namespace, names: list[str]) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536", MALLOC_ARENA_MAX="2",
               OMP_NUM_THREADS=os.environ.get("BENCH_THREADS", "2"))
    rows = []
    for name in names:
        out = f"/tmp/planner-bench-{os.getpid()}-{name}.json"
        subprocess.run([sys.executable, __file__, "--worker", name, "--device", ns.device, "--dtype", ns.dtype,
                        "--shape", json.dumps(SHAPE), "--json-out", out], check=True, env=env)
        row = json.loads(Path(out).read_text())
        os.unlink(out)
        row["ratio_device"] = row["predicted_peak"] / row["device_peak"]
        row["ratio_live"] = row["predicted_peak"] / row["live_peak"]
        rows.append(row)
        print(f"{name:10} saved {row['saved'] / MiB:7.1f} (pred {row['predicted_saved'] / MiB:7.1f})  peak: device "
              f"{row['device_peak'] / MiB:7.1f} live {row['live_peak'] / MiB:7.1f} pred {row['predicted_peak'] / MiB:7.1f}"
              f" ({row['predicted_at']})  pred/device {row['ratio_device']:.3f}", flush=True)
    return rows


def run_time(ns: argparse.Namespace, names: list[str], budget: int | None) -> dict:
    import torch

    from trl_gc_plugin.planning import planner

    cuda = ns.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    model, batch = build(ns.device, ns.dtype)
    est, table = table_for(model, cuda)
    by_name = {c.name: c for c in table}
    planned = None
    if budget is not None:
        result = planner.plan(est, budget, allow_selective=True, allow_offload=cuda)
        planned = result.chosen.name if result.chosen else None
        if planned and planned not in names:
            names = [*names, planned]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.thread_time()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - wall, time.thread_time() - cpu

    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for name in names:  # warm-up
        planner.apply_plan(model, by_name[name], use_reentrant=False)
        for _ in range(ns.warmup):
            step()
    loads = []
    for r in range(ns.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            planner.apply_plan(model, by_name[name], use_reentrant=False)
            wall, cpu = step()
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
        loads.append(os.getloadavg()[0])
        print(f"round {r}: " + ", ".join(f"{n} {times[n]['wall'][-1]:.3f}s" for n in names), flush=True)
    metric = "wall" if cuda else "cpu"
    summary = {}
    full = statistics.median(times["full"][metric])
    for name in names:
        values = times[name][metric]
        summary[name] = {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "wall_median_s": statistics.median(times[name]["wall"]),
            "spread": (max(values) - min(values)) / statistics.median(values),
            "vs_full": statistics.median(values) / full,
            "vs_none": statistics.median(values) / statistics.median(times["none"][metric]),
            "all_s": [round(v, 5) for v in values],
        }
    return {"metric": "thread CPU time (1 thread)" if not cuda else "wall time, synchronized",
            "summary": summary, "planned": planned, "load_average": loads}


def run_exact(ns: argparse.Namespace) -> dict:
    import torch

    from trl_gc_plugin.planning import planner

    model, batch = build(ns.device, ns.dtype)
    _, table = table_for(model, ns.device == "cuda")

    def grads() -> dict:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        model(**batch).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads()  # full non-reentrant (as built)
    again = grads()
    out: dict = {"full (run twice)": all(torch.equal(again[k], reference[k]) for k in reference)}
    diffs = {}
    for c in table:
        if not c.allowed:
            continue
        planner.apply_plan(model, c, use_reentrant=False)
        got = grads()
        out[c.name] = all(torch.equal(got[k], reference[k]) for k in reference)
        diffs[c.name] = max(float((got[k].float() - reference[k].float()).abs().max()) for k in reference)
    out["max_abs_difference"] = diffs
    out["max_abs_gradient"] = max(float(g.float().abs().max()) for g in reference.values())
    return out


def run_layouts() -> list[dict]:
    from trl_gc_plugin.cli import plan as plan_cli
    from trl_gc_plugin.core.units import parse_size
    from trl_gc_plugin.planning import memory, planner

    rows = []
    for layout, batch, seq, shards in LAYOUT_CASES:
        config, _ = plan_cli.load_config(layout)
        est = memory.estimate(config, batch, seq, dtype="bf16", attn_implementation="sdpa")
        row = {"layout": layout, "batch": batch, "seq": seq, "grad_shards": shards}
        for budget in LAYOUT_BUDGETS:
            result = planner.plan(est, parse_size(budget), allow_selective=True, allow_offload=True,
                                  grad_fraction=1 / shards)
            c = result.chosen or result.lowest
            row[budget] = {"plan": c.name if result.fits else None, "peak": c.peak_bytes, "fits": result.fits,
                           "recompute": round(c.recompute, 3), "lowest": result.lowest.name,
                           "lowest_peak": result.lowest.peak_bytes}
        none = planner.predict_peak(est, (False,) * est.num_blocks, grad_fraction=1 / shards)[0]
        full = planner.predict_peak(est, (True,) * est.num_blocks, grad_fraction=1 / shards)[0]
        row.update(none_peak=none, full_peak=full)
        rows.append(row)
        print(f"{layout:10} b={batch} s={seq} shards={shards}: none {none / 2**30:.1f} GiB, full {full / 2**30:.1f} GiB; "
              + ", ".join(f"{b}: {row[b]['plan'] or 'nothing fits (' + row[b]['lowest'] + ')'}" for b in LAYOUT_BUDGETS),
              flush=True)
    return rows


def run_cost() -> dict:
    """The planner's own cost on a 7B layout at sequence 4096: first call (imports of the model code included),
    then repeats; the RSS peak growth shows no tensor memory is allocated (two real bf16 blocks would be 0.8 GiB)."""
    import resource

    from trl_gc_plugin.cli import plan as plan_cli
    from trl_gc_plugin.planning import memory, planner

    config, _ = plan_cli.load_config("llama-7b")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(4):
        start = time.perf_counter()
        est = memory.estimate(config, 1, 4096, dtype="bf16")
        planner.plan(est, 40 * 2**30, allow_selective=True, allow_offload=False)
        times.append(time.perf_counter() - start)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"first_s": times[0], "repeat_s": times[1:], "rss_peak_growth_bytes": grown,
            "estimated_saved_no_checkpointing_bytes": est.saved_bytes((False,) * 32)}


def run_korthikanti() -> dict:
    from trl_gc_plugin.cli import plan as plan_cli
    from trl_gc_plugin.planning import memory

    config, _ = plan_cli.load_config("llama-7b")
    s, h, a = 4096, 4096, 32
    out = {}
    for attn in ("sdpa", "eager"):
        est = memory.estimate(config, 1, s, dtype="bf16", attn_implementation=attn)
        out[attn] = {"measured_bytes_per_sbh": est.saved[1] / (s * h), "measured_layer_bytes": est.saved[1],
                     "selective_keeps_per_sbh": (est.inputs[1] + est.selective[1]) / (s * h),
                     "outside_bytes": est.outside}
    out["korthikanti_flash_per_sbh"] = 34.0
    out["korthikanti_eager_per_sbh"] = 34.0 + 5.0 * a * s / h
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    mem = {r["name"]: r for r in result.get("memory", [])}
    timing = result.get("time", {}).get("summary", {})
    names = [n for n in timing if n in mem]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for n in names:
        x, y = mem[n]["device_peak"] / MiB, timing[n]["median_s"]
        ax.scatter(x, y, s=60, color="tab:blue")
        ax.scatter(mem[n]["predicted_peak"] / MiB, y, s=40, marker="x", color="tab:gray")
        ax.annotate(n, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    planned = result["time"].get("planned")
    if planned in mem:
        ax.scatter(mem[planned]["device_peak"] / MiB, timing[planned]["median_s"], s=260, facecolors="none",
                   edgecolors="tab:red", linewidths=2, label=f"planner's pick: {planned}")
    if result.get("budget"):
        ax.axvline(result["budget"] / MiB, color="tab:red", linestyle="--", linewidth=1, label="budget (midway)")
    ax.scatter([], [], marker="x", color="tab:gray", label="predicted peak")
    ax.set_xlabel(f"activation peak, MiB ({mem[names[0]]['device_metric']})", fontsize=8)
    ax.set_ylabel(f"step time, s (median, {result['time']['metric']})", fontsize=8)
    s = SHAPE
    ax.set_title(f"Llama hidden {s['hidden']}, {s['layers']} layers, seq {s['seq']}, batch {s['batch']}, "
                 f"{result['dtype']} on {result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--skip-layouts", action="store_true")
    parser.add_argument("--exact-only", action="store_true", help="only the gradient comparison")
    parser.add_argument("--out", default=None, help="results file (default results/planner.json, _cuda on CUDA)")
    parser.add_argument("--shape", default=None, help='JSON overrides of the model shape, e.g. \'{"hidden": 4096}\'')
    parser.add_argument("--timed", default=None, help="comma-separated candidates to time (default: the main ones)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    ns.dtype = ns.dtype or ("bfloat16" if ns.device == "cuda" else "float32")
    if ns.shape:
        SHAPE.update(json.loads(ns.shape))
    if ns.worker:
        memory_worker(ns.worker, ns.device, ns.dtype, ns.json_out)
        return
    import torch
    import transformers

    out = Path(ns.out) if ns.out else RESULTS / ("planner_cuda.json" if ns.device == "cuda" else "planner.json")
    result: dict = {"shape": SHAPE, "device": ns.device, "dtype": ns.dtype, "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name() if ns.device == "cuda" else None}
    model, _ = build(ns.device, ns.dtype)
    _, table = table_for(model, ns.device == "cuda")
    del model
    names = [c.name for c in table if c.allowed]
    if not ns.skip_memory and not ns.exact_only:
        result["memory"] = run_memory(ns, names)
        mem = {r["name"]: r for r in result["memory"]}
        result["budget"] = (mem["full"]["device_peak"] + mem["none"]["device_peak"]) // 2
        result["prediction_within_10pct"] = all(abs(r["ratio_device"] - 1) <= 0.10 for r in result["memory"])
    if not ns.skip_time and not ns.exact_only:
        wanted = ns.timed.split(",") if ns.timed else (*TIMED, "offload")
        timed = [n for n in wanted if n in names]
        result["time"] = run_time(ns, timed, result.get("budget"))
        planned = result["time"]["planned"]
        if planned and "memory" in result:
            mem = {r["name"]: r for r in result["memory"]}
            pick = result["time"]["summary"][planned]
            result["planned_run"] = {
                "name": planned,
                "measured_peak": mem[planned]["device_peak"],
                "under_budget": mem[planned]["device_peak"] <= result["budget"],
                "step_time_vs_full": pick["vs_full"],
                "step_time_reduction_vs_full": 1 - pick["vs_full"],
            }
    result["gradients_equal_full"] = run_exact(ns)
    if ns.exact_only:
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["gradients_equal_full"], indent=2))
        return
    result["korthikanti"] = run_korthikanti()
    result["planner_cost"] = run_cost()
    if not ns.skip_layouts:
        result["layouts"] = run_layouts()
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if "memory" in result:
        import csv

        with open(out.with_suffix(".csv"), "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["candidate", "saved_mib", "predicted_saved_mib", "device_peak_mib", "live_peak_mib",
                             "predicted_peak_mib", "predicted_over_device", "median_step_s"])
            timing = result.get("time", {}).get("summary", {})
            for r in result["memory"]:
                writer.writerow([r["name"], round(r["saved"] / MiB, 2), round(r["predicted_saved"] / MiB, 2),
                                 round(r["device_peak"] / MiB, 2), round(r["live_peak"] / MiB, 2),
                                 round(r["predicted_peak"] / MiB, 2), round(r["ratio_device"], 4),
                                 round(timing[r["name"]]["median_s"], 4) if r["name"] in timing else ""])
    if "time" in result:
        plot(result, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("planned_run", "prediction_within_10pct", "gradients_equal_full")
                      if k in result}, indent=2))


if __name__ == "__main__":
    main()
