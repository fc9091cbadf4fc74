"""The planner side by side with PyTorch's own memory budget (issue 47): at three activation budgets between no
checkpointing and full checkpointing (a quarter, half and three quarters of the way), on CPU:

- `eager plan`: eager, the plugin's plan (`planner.plan`, applied with `planner.apply_plan`);
- `compiled budget`: `torch.compile` (inductor) with no checkpointing and the AOTAutograd min-cut partitioner's
  `torch._functorch.config.activation_memory_budget`, swept (bisection) until the saved bytes fit the budget;
- `compiled plan`: `torch.compile` of the model with the plugin's plan inside (transformers' checkpointing with the
  plan's layout: torch's checkpoint becomes a higher-order op whose regions the partitioner recomputes);

plus the two ends, no checkpointing and full, eager and compiled. For each: the saved activation bytes, measured
the same way for eager and compiled (the process's allocated heap, glibc `mallinfo2`, after the forward less before
it; the forward returns the loss only), the step time (forward and backward; main-thread CPU time on one intra-op
thread, the minimum over interleaved rounds, the order reversed every round) and, compiled, the compile time (the
first forward and backward, wall time).

The budget at fraction f: `B = S_full + f (S_none - S_full)` of the saved bytes measured eagerly with full and with no
checkpointing. The planner is asked at the same fraction of the way between its own predicted peaks of full and no
checkpointing (as `planner_mixed.py` does). The partitioner sweep compiles with `aot_eager_decomp_partition` (the
same decompositions and min-cut partitioner as inductor, without code generation) and keeps the largest budget
whose saved bytes are at most B; then inductor compiles at that value for the timed arm.

    .venv-tf5/bin/python benchmarks/vs_compile.py [--quick] [--rounds 5]

Writes benchmarks/results/vs_compile.json (vs_compile_quick.json with `--quick`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import tempfile
import time
import types
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPE = {"hidden": 256, "intermediate": 688, "layers": 2, "heads": 4, "vocab": 2000, "batch": 2, "seq": 256}
QUICK = {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 2, "vocab": 128, "batch": 1, "seq": 32}
FRACTIONS = (0.25, 0.5, 0.75)
SWEEP_STEPS = 5
PLAN_GRID = 24


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo2


def allocated() -> int:
    """Bytes the process holds from malloc: in use in the arenas plus mmapped chunks (tensors above the mmap
    threshold)."""
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def build(shape: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    s = shape
    config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["heads"], vocab_size=s["vocab"],
                         max_position_embeddings=s["seq"], use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def compilable(model):
    """The plugin's selective blocks with a plain function as `context_fn`: dynamo takes a function or a
    `functools.partial` there and refuses the plugin's own (`policies.Faithful`, a frozen dataclass instance:
    "checkpoint not implemented for FrozenDataClassVariable context_fn", torch 2.13)."""
    import functools

    from trl_gc_plugin.model import ckpt

    wrapped = 0
    for block in ckpt.blocks(model):
        func = ckpt.function_of(block)
        part = ckpt.inner(func) if func is not None else None
        context_fn = part.keywords.get("context_fn") if isinstance(part, functools.partial) else None
        if context_fn is not None and not isinstance(context_fn, types.FunctionType | functools.partial):
            def plain(_fn=context_fn):
                return _fn()

            setattr(block, ckpt.FUNC, functools.partial(part.func, *part.args, **{**part.keywords,
                                                                                  "context_fn": plain}))
            wrapped += 1
    model._bench_wrapped = wrapped
    return model


def loss_fn(model, name: str):
    """`ids -> loss` with its own code object: dynamo keeps one cache per code object, so every compiled arm keeps
    its own graph (the partitioner's budget is read when that arm compiles)."""

    def step(ids):
        return model(input_ids=ids, labels=ids).loss

    step.__code__ = step.__code__.replace(co_name=f"step_{name.replace(' ', '_').replace('@', '_').replace('.', '_')}")
    return step


def saved_bytes(fn, model, ids) -> int:
    """The bytes the forward leaves allocated for the backward (min of two)."""
    out = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        gc.collect()
        before = allocated()
        loss = fn(ids)
        gc.collect()
        out.append(allocated() - before)
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return min(out)


def compile_arm(model, name: str, budget: float | None, backend: str = "inductor"):
    """Compile `model`'s loss under the partitioner `budget` (None: torch's default); (fn, compile seconds)."""
    import torch

    fn = torch.compile(loss_fn(model, name), backend=backend)
    ids = model._bench_ids
    start = time.perf_counter()
    with torch._functorch.config.patch(activation_memory_budget=1.0 if budget is None else budget):
        fn(ids).backward()
    model.zero_grad(set_to_none=True)
    return fn, time.perf_counter() - start


def run(shape: dict, rounds: int) -> dict:
    import torch
    import torch._dynamo

    from trl_gc_plugin.planning import memory, planner

    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    ids = torch.randint(shape["vocab"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(1))

    def fresh(layout_of=None):
        model = build(shape)
        model._bench_ids = ids
        if layout_of == "none":
            model.gradient_checkpointing_disable()
        elif layout_of is not None:
            planner.apply_plan(model, layout_of, use_reentrant=False)
        return model


    # the plans
    probe_model = fresh()
    est = memory.estimate(probe_model, shape["batch"], shape["seq"])
    table = planner.candidates(est, allow_selective=True, allow_offload=False)
    by = {c.name: c for c in table}
    p_full, p_none = by["full"].peak_bytes, by["none"].peak_bytes
    offset = p_full - by["full"].saved_bytes  # what the predicted peak holds besides the saved bytes

    def plan_for(saved_target: int):
        """The planner's pick for a budget whose saved activations are `saved_target` (the rest of its predicted
        peak as under full checkpointing)."""
        return planner.plan(est, round(saved_target + offset), allow_selective=True, allow_offload=False,
                            device="cpu").chosen

    # eager arms: the ends first (they set the eager budgets), then the plugin's plan at each
    arms: dict[str, dict] = {}

    def eager_arm(name: str, layout) -> None:
        model = fresh(layout)
        fn = loss_fn(model, name)
        fn(ids).backward()  # warm-up
        model.zero_grad(set_to_none=True)
        arms[name] = {"fn": fn, "model": model, "saved": saved_bytes(fn, model, ids)}
        print(f"{name}: saved {arms[name]['saved']}", flush=True)

    # every distinct pick of the planner over its range (the frontier of predicted recompute against saved bytes)
    picks = {}
    for i in range(PLAN_GRID + 1):
        c = plan_for(round(by["full"].saved_bytes + i / PLAN_GRID * (by["none"].saved_bytes - by["full"].saved_bytes)))
        if c is not None:
            picks.setdefault(str(c.layout), c)

    eager_arm("eager none", "none")
    eager_arm("eager full", by["full"])
    e_full, e_none = arms["eager full"]["saved"], arms["eager none"]["saved"]
    eager_budgets = {f: round(e_full + f * (e_none - e_full)) for f in FRACTIONS}
    plans = {}
    for f in FRACTIONS:  # the least predicted recompute whose predicted saved bytes fit (the planner's own figures)
        plans[f] = min((c for c in picks.values() if c.saved_bytes <= eager_budgets[f]), key=lambda c: c.recompute,
                       default=by["full"])
        print(f"plan at {f}: {plans[f].summary()} (predicted saved {plans[f].saved_bytes})", flush=True)
        eager_arm(f"eager plan@{f}", plans[f])

    compiled: dict[tuple, str] = {}  # (layout, partitioner budget) -> the arm that runs it (one compile each)

    def compiled_arm(name: str, layout, b: float | None) -> None:
        key = (str(layout.layout) if hasattr(layout, "layout") else layout, b)
        if key in compiled:  # the same layout and budget as an arm already compiled: the same measurement
            arms[name] = {**arms[compiled[key]], "same_as": compiled[key]}
            return
        model = compilable(fresh(layout))
        fn, took = compile_arm(model, name, b)
        arms[name] = {"fn": fn, "model": model, "saved": saved_bytes(fn, model, ids), "compile_s": round(took, 1),
                      "context_fn_wrapped_blocks": model._bench_wrapped}
        compiled[key] = name
        print(f"{name}: compiled in {took:.1f} s, saved {arms[name]['saved']}", flush=True)

    compiled_arm("compiled none", "none", None)
    compiled_arm("compiled full", by["full"], None)
    c_full, c_none = arms["compiled full"]["saved"], arms["compiled none"]["saved"]
    budgets = {f: round(c_full + f * (c_none - c_full)) for f in FRACTIONS}

    # the partitioner's sweep (no code generation), on one model without checkpointing
    sweep_model = fresh("none")
    points: dict[float, int] = {}

    def at(b: float) -> int:
        if b not in points:
            fn, took = compile_arm(sweep_model, f"sweep {b:.5f}", b, backend="aot_eager_decomp_partition")
            points[b] = saved_bytes(fn, sweep_model, ids)
            print(f"sweep: activation_memory_budget {b:.4f} saves {points[b]} ({took:.1f} s)", flush=True)
        return points[b]

    at(0.0)
    chosen_budget = {}
    for f, target in budgets.items():
        fits = [b for b, s in points.items() if s <= target]
        over = [b for b, s in points.items() if s > target]
        lo = max(fits) if fits else 0.0
        hi = min([b for b in over if b > lo], default=1.0)
        for _ in range(SWEEP_STEPS):
            if hi - lo < 1e-3 or (lo in points and points[lo] >= 0.97 * target):  # within 3% below: close enough
                break
            mid = round((lo + hi) / 2, 5)
            if at(mid) <= target:
                lo = mid
            else:
                hi = mid
        chosen_budget[f] = lo
        print(f"budget {f}: {target} bytes -> activation_memory_budget {lo} (saves {points.get(lo)})", flush=True)

    # the plugin's plans for the compiled model: every distinct pick over the planner's range, each compiled
    # (no code generation) and measured; per budget the one of least predicted recompute that fits it
    plan_points = {}
    for key, c in picks.items():
        model = compilable(fresh(c))
        fn, took = compile_arm(model, f"plans {len(plan_points)}", None, backend="aot_eager_decomp_partition")
        plan_points[key] = saved_bytes(fn, model, ids)
        print(f"plan sweep: {c.summary()} saves {plan_points[key]} compiled ({took:.1f} s)", flush=True)
    compiled_plans = {}
    for f, target in budgets.items():
        fitting = [c for k, c in picks.items() if plan_points[k] <= target]
        compiled_plans[f] = min(fitting, key=lambda c: c.recompute) if fitting else by["full"]
        print(f"compiled plan at {f}: {compiled_plans[f].summary()}", flush=True)

    for f in FRACTIONS:
        compiled_arm(f"compiled budget@{f}", "none", chosen_budget[f])
        compiled_arm(f"compiled plan@{f}", compiled_plans[f], None)

    # gradients against eager full checkpointing
    def grads(name):
        a = arms[name]
        a["model"].zero_grad(set_to_none=True)
        a["fn"](ids).backward()
        g = {n: p.grad.clone() for n, p in a["model"].named_parameters() if p.grad is not None}
        a["model"].zero_grad(set_to_none=True)
        return g

    reference = grads("eager full")
    for name in arms:
        if "same_as" in arms[name]:
            continue
        got = grads(name)
        arms[name]["grad_max_rel_diff"] = float(max(
            ((got[k] - reference[k]).abs().max() / reference[k].abs().max().clamp_min(1e-30)).item()
            for k in reference))

    # interleaved timing
    names = [n for n in arms if "same_as" not in arms[n]]
    times: dict[str, list[float]] = {n: [] for n in names}

    def step(name) -> float:
        a = arms[name]
        start = time.thread_time()
        a["fn"](ids).backward()
        a["model"].zero_grad(set_to_none=True)
        return time.thread_time() - start

    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(step(name))
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f}" for n in names), flush=True)

    out_arms = {}
    for name in arms:
        if "same_as" in arms[name]:
            out_arms[name] = {"same_as": arms[name]["same_as"]}
            continue
        a = arms[name]
        out_arms[name] = {"saved_bytes": a["saved"], "step_s": round(min(times[name]), 4),
                          "all_s": [round(t, 4) for t in times[name]],
                          "grad_max_rel_diff_vs_eager_full": a["grad_max_rel_diff"]}
        if "compile_s" in a:
            out_arms[name]["compile_and_first_step_s"] = a["compile_s"]
            out_arms[name]["context_fn_wrapped_blocks"] = a["context_fn_wrapped_blocks"]
    table_rows = {}
    for kind in ("eager", "compiled"):
        t_full, t_none = out_arms[f"{kind} full"]["step_s"], out_arms[f"{kind} none"]["step_s"]
        for name in names:
            if name.startswith(kind):
                out_arms[name]["share_removed"] = round((t_full - out_arms[name]["step_s"]) / (t_full - t_none), 3)
    for f in FRACTIONS:
        table_rows[str(f)] = {
            "budget_saved_bytes_compiled": budgets[f],
            "budget_saved_bytes_eager": eager_budgets[f],
            "plan": plans[f].summary(),
            "plan_predicted_saved_bytes": plans[f].saved_bytes,
            "compiled_plan": compiled_plans[f].summary(),
            "activation_memory_budget": chosen_budget[f],
            "arms": {k: f"{k}@{f}" for k in ("eager plan", "compiled budget", "compiled plan")},
        }
        row = table_rows[str(f)]
        for k, arm in row["arms"].items():
            limit = eager_budgets[f] if k.startswith("eager") else budgets[f]
            row[f"{k} fits"] = arms[arm]["saved"] <= limit
    return {"budgets": table_rows, "arms": out_arms,
            "sweep": {str(b): s for b, s in sorted(points.items())},
            "plan_sweep": {picks[k].summary(): v for k, v in plan_points.items()},
            "planner_predicted": {"full_peak": p_full, "none_peak": p_none,
                                  "full_saved": by["full"].saved_bytes, "none_saved": by["none"].saved_bytes}}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(result: dict) -> str:
    """The Markdown table of docs/benchmarks.md from a results file."""
    arms = result["arms"]

    def arm(name: str) -> dict:
        return arms[arms[name]["same_as"]] if "same_as" in arms[name] else arms[name]

    def cell(name: str, fits: bool | None = None) -> str:
        a = arm(name)
        mark = "" if fits is None or fits else " (over)"
        compile_s = f", compile {a['compile_and_first_step_s']:.0f} s" if "compile_and_first_step_s" in a else ""
        return (f"{a['saved_bytes'] / 2**20:.1f} MiB{mark}, {a['step_s'] * 1000:.0f} ms "
                f"({a['share_removed']:.2f}){compile_s}")

    lines = ["| budget | eager, plugin's plan | compiled, partitioner's budget | compiled, plugin's plan |",
             "|---|---|---|---|"]
    for kind in ("none", "full"):
        lines.append(f"| {kind} (end) | {cell('eager ' + kind)} | {cell('compiled ' + kind)} | {cell('compiled ' + kind)} |")
    for f, row in result["budgets"].items():
        a = row["arms"]
        lines.append(
            f"| {float(f):.0%}: eager {row['budget_saved_bytes_eager'] / 2**20:.1f} MiB, compiled "
            f"{row['budget_saved_bytes_compiled'] / 2**20:.1f} MiB | {cell(a['eager plan'], row['eager plan fits'])} "
            f"{row['plan']} | {cell(a['compiled budget'], row['compiled budget fits'])}, "
            f"activation_memory_budget {row['activation_memory_budget']:.3f} | "
            f"{cell(a['compiled plan'], row['compiled plan fits'])} {row.get('compiled_plan', row['plan'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and two rounds: does it run")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (30; 2 with --quick)")
    parser.add_argument("--out", default=None, help="results file name under results/")
    parser.add_argument("--table", default=None, help="print the Markdown table of a results file and exit")
    ns = parser.parse_args()
    if ns.table:
        print(table(json.loads(Path(ns.table).read_text())))
        return
    # a cache of its own: compile times are not another run's cache hits (within the run, identical graphs hit)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="vs_compile_inductor_"))
    shape = dict(QUICK if ns.quick else SHAPE)
    rounds = ns.rounds or (2 if ns.quick else 30)
    import torch
    import transformers

    start = time.perf_counter()
    result = {"shape": shape, "fractions": FRACTIONS, "rounds": rounds, "python": platform.python_version(),
              "torch": torch.__version__, "transformers": transformers.__version__, "cpu": cpu_name(),
              "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(), "intra_op_threads": 1}
    result.update(run(shape, rounds))
    result["total_s"] = round(time.perf_counter() - start, 1)
    result["load_average_at_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    name = ns.out or ("vs_compile_quick.json" if ns.quick else "vs_compile.json")
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"budgets": result["budgets"],
                      "arms": {k: {x: v[x] for x in v if x != "all_s"} for k, v in result["arms"].items()}},
                     indent=2))
    print(f"total {result['total_s']} s")


if __name__ == "__main__":
    main()
