"""The planner's selective and lean policies under `torch.compile` (issue 22: a selective path without per-op Python
cost). In eager mode selective checkpointing runs its policy in Python for every aten op, forward and recompute (a
`TorchDispatchMode`); under `torch.compile` the checkpointed regions are traced and the policy decides once, at
trace time, what the compiled graph saves. Measured: step time of no, full, selective and lean checkpointing, each
compiled (inductor), interleaved; gradients against full checkpointing's, bit for bit.

Method: the CPU model of `planner_mixed.py` (Llama-shaped, hidden 512, intermediate 1376, 8 layers, 8 heads,
vocabulary 8000; batch 2 x 512 tokens; float32, SDPA), one intra-op thread, main-thread CPU time, one model per arm
(the same seed), each compiled once before timing; medians over the rounds. The eager step times of the same arms
are measured too, for comparison.

    .venv-tf5/bin/python benchmarks/compile_selective.py [--rounds 7] [--seq 512] [--device cuda]

Writes benchmarks/results/compile_selective.json (compile_selective_cuda.json on CUDA).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SHAPE = {"hidden": 512, "intermediate": 1376, "layers": 8, "heads": 8, "vocab": 8000, "batch": 2, "seq": 512}  # planner_mixed.py's
ARMS = ("none", "full", "selective", "lean")


def build(arm: str, device: str):
    """The model of `planner_mixed.py` (its `build`, same seed and shape) with `arm`'s checkpointing."""
    import planner_mixed

    from trl_gc_plugin.core.layout import Layout
    from trl_gc_plugin.model import ckpt

    planner_mixed.SHAPE.update(SHAPE)
    planner_mixed.DEVICE["name"] = device
    model, batch = planner_mixed.build()  # checkpointing on, non-reentrant
    if arm == "none":
        model.gradient_checkpointing_disable()
    if arm in ("selective", "lean"):
        ckpt.apply(model, ckpt.Spec(layout=Layout.from_pattern(ckpt.layout_of(model).pattern, arm)))
    return model, batch


def run(rounds: int, device: str) -> dict:
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
    cuda = device == "cuda"
    built = {arm: build(arm, device) for arm in ARMS}
    models = {arm: model for arm, (model, _) in built.items()}
    ids = built["none"][1]["input_ids"]
    compiled = {arm: torch.compile(m) for arm, m in models.items()}

    def step(arm: str, eager: bool = False) -> float:
        models[arm].zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter() if cuda else time.thread_time()
        (models[arm] if eager else compiled[arm])(input_ids=ids, labels=ids).loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() if cuda else time.thread_time()) - start

    compile_s = {}
    for arm in ARMS:
        start = time.perf_counter()
        step(arm)
        compile_s[arm] = round(time.perf_counter() - start, 1)
        print(f"{arm}: compiled and ran in {compile_s[arm]} s", flush=True)
    grads = {arm: {n: p.grad.clone() for n, p in m.named_parameters()} for arm, m in models.items()}
    equal = {arm: all(torch.equal(grads[arm][k], grads["full"][k]) for k in grads["full"]) for arm in ARMS}
    times: dict[str, list[float]] = {f"{arm} {kind}": [] for arm in ARMS for kind in ("compiled", "eager")}
    for arm in ARMS:
        step(arm, eager=True)  # warm-up
    for r in range(rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            times[f"{arm} compiled"].append(step(arm))
            times[f"{arm} eager"].append(step(arm, eager=True))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    removed = {}
    for kind in ("compiled", "eager"):
        full, none = median[f"full {kind}"], median[f"none {kind}"]
        removed[kind] = {arm: round((full - median[f"{arm} {kind}"]) / (full - none), 3) for arm in ARMS}
    return {"compile_and_first_step_s": compile_s, "gradients_equal_full_compiled": equal,
            "median_s": {k: round(v, 4) for k, v in median.items()},
            "spread": {k: round((max(v) - min(v)) / statistics.median(v), 3) for k, v in times.items()},
            "share_removed": removed, "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq", type=int, default=SHAPE["seq"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ns = parser.parse_args()
    SHAPE["seq"] = ns.seq
    import torch
    import transformers

    result = {"shape": SHAPE, "python": platform.python_version(), "torch": torch.__version__,
              "transformers": transformers.__version__, "device": ns.device, "rounds": ns.rounds}
    result.update(run(ns.rounds, ns.device))
    RESULTS.mkdir(exist_ok=True)
    name = "compile_selective.json" if ns.device == "cpu" else "compile_selective_cuda.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("gradients_equal_full_compiled", "median_s", "share_removed")}, indent=2))


if __name__ == "__main__":
    main()
