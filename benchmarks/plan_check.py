"""The memory plan against the first real step, per trainer: predicted vs measured saved bytes and what the check
costs.

Tiny Llama (4 layers, hidden 128, intermediate 1024, vocab 300, built offline), per-device batch 4, TRL trainers with
`max_length=128` (the issue's setting), CPU, fp32. For each trainer (Trainer, SFT, DPO, GRPO), two real runs of
two steps with `SafeGCCallback(memory_budget="1TiB")`: strict (the plan, no checkpointing, is applied) and warn (not
applied: every block checkpointed). Reported from the callback's own check (`callback.plan_check`): the batch shape
of the first training forward, the prediction for it and what that forward saved.

The check's cost: the first training forward's keyword arguments are recorded, then forward + backward of the model
on them runs with and without what the check adds (`memory.meter` around the forward: its saved-tensor hook and
block hooks; then `plan_check.compare`), interleaved, the order reversed every round, one intra-op thread, CPU time
of the calling thread (`time.thread_time`). The direct figure is the CPU time spent inside the check's own code
(entering/leaving the meter, every hook call, the comparison), median over the rounds; the difference of the two
step medians is kept too, but on a shared 2-core machine it moves by more than the check costs. Shares: of that
forward + backward (a lower bound of a step, so an upper bound of the share) and of the trainer's own first step
(`on_step_begin` to `on_step_end` of step 1, wall clock). The planning itself (`memory.estimate` at the planned shape and,
when it differs, at the real one) is timed apart: it is the plan's cost, paid with or without the check.

    .venv-tf5/bin/python benchmarks/plan_check.py [--rounds 30]

Writes benchmarks/results/plan_check.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

RESULTS = Path(__file__).parent / "results"
BATCH, MAX_LENGTH, LAYERS = 4, 128, 4
KINDS = ("trainer", "sft", "dpo", "grpo")


def build_model():
    from trl_gc_plugin.testing import make_model

    return make_model(num_hidden_layers=LAYERS, hidden_size=128, intermediate_size=1024, max_position_embeddings=256)


def run(kind: str, mode: str, out: str) -> dict:
    import torch
    from trainers import make_trainer
    from transformers import TrainerCallback

    from trl_gc_plugin import SafeGCCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)

    recorded: dict = {}

    def record(module, args, kwargs):
        if not recorded and module.training and torch.is_grad_enabled():
            recorded.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    model = build_model()
    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    callback, clock = SafeGCCallback(mode=mode, memory_budget="1TiB"), StepClock()
    extra = {"max_length": MAX_LENGTH} if kind in ("sft", "dpo") else {}
    trainer = make_trainer(kind, model, out, callbacks=[callback, clock], max_steps=2,
                           per_device_train_batch_size=BATCH, **extra)
    trainer.train()
    handle.remove()
    check = callback.plan_check
    plan = next(d for d in callback.decisions if d.rule_id == "memory-plan" and d.setting == "checkpointing_plan")
    reported = [d for d in callback.decisions if d.setting == "memory_plan_check"]
    return {
        "kind": kind,
        "mode": mode,
        "plan": plan.after["plan"],
        "planned_shape": [plan.after["estimate"]["batch_size"], plan.after["estimate"]["seq_len"]],
        "check": check.to_dict() if check is not None else None,
        "reported": bool(reported),
        "first_step_s": clock.times[0],
        "step2_s": clock.times[1] if len(clock.times) > 1 else None,
        "_trainer": trainer,
        "_kwargs": recorded,
    }


def check_cost(trainer, kwargs: dict, rounds: int) -> dict:
    import torch

    from trl_gc_plugin.planning import memory, plan_check

    model = trainer.model
    model.train()
    rows, tokens = kwargs["input_ids"].shape
    t0 = time.perf_counter()
    est = memory.estimate(model, int(rows), int(tokens),
                          forward_kwargs={k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)})
    estimate_s = time.perf_counter() - t0

    inside = {"s": 0.0, "calls": 0}

    def timed(func):
        def wrapper(*args, **kw):
            t = time.thread_time()
            try:
                return func(*args, **kw)
            finally:
                inside["s"] += time.thread_time() - t
                inside["calls"] += 1

        return wrapper

    originals = {name: getattr(memory._Counter, name) for name in ("pack", "enter", "leave")}

    def step(metered: bool) -> tuple[float, float, int]:
        model.zero_grad(set_to_none=True)
        inside.update(s=0.0, calls=0)
        start = time.thread_time()
        if metered:
            t = time.thread_time()
            with memory.meter(model) as saved:  # what the check runs around the first training forward
                inside["s"] += time.thread_time() - t
                out = model(**kwargs)
                t = time.thread_time()
            plan_check.compare(est, saved, model)
            inside["s"] += time.thread_time() - t
        else:
            out = model(**kwargs)
        out.loss.backward()
        return time.thread_time() - start, inside["s"], inside["calls"]

    torch.set_num_threads(1)  # every op on this thread: its CPU time is the step's
    plain, metered, direct, calls = [], [], [], 0
    try:
        for name, func in originals.items():
            setattr(memory._Counter, name, timed(func))
        for _ in range(3):
            step(False), step(True)
        for i in range(rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            for flag in order:
                elapsed, hooks, calls_now = step(flag)
                (metered if flag else plain).append(elapsed)
                if flag:
                    direct.append(hooks)
                    calls = calls_now
    finally:
        for name, func in originals.items():
            setattr(memory._Counter, name, func)
        torch.set_num_threads(2)
    base, with_check = statistics.median(plain), statistics.median(metered)
    return {
        "forward_backward_cpu_s": base,
        "forward_backward_with_check_cpu_s": with_check,
        "difference_of_medians_s": with_check - base,
        "check_direct_s": statistics.median(direct),
        "check_share_of_forward_backward": statistics.median(direct) / base,
        "saved_tensor_hook_and_block_hook_calls": calls,
        "estimate_at_real_shape_s": estimate_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    opts = parser.parse_args()
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            for mode in ("strict", "warn"):
                row = run(kind, mode, f"{tmp}/{kind}-{mode}")
                trainer, kwargs = row.pop("_trainer"), row.pop("_kwargs")
                if mode == "strict":
                    row["cost"] = check_cost(trainer, kwargs, opts.rounds)
                    row["cost"]["check_share_of_first_step"] = row["cost"]["check_direct_s"] / row["first_step_s"]
                rows.append(row)
                c = row["check"]
                cost = row.get("cost")
                print(f"{kind:8} {mode:6} plan {row['plan']:5} shape {c['batch_shape']} (planned {row['planned_shape']}) "
                      f"predicted {c['predicted']:>10,} measured {c['measured']:>10,} x{c['ratio']:.3f} "
                      f"reported={row['reported']}"
                      + (f"  check {cost['check_direct_s'] * 1e3:.2f} ms = {cost['check_share_of_forward_backward']:.2%} "
                         f"of fwd+bwd, {cost['check_share_of_first_step']:.2%} of step 1" if cost else ""))
    result = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "trl": trl.__version__, "threads": 2,
                    "processor": platform.processor() or platform.machine()},
        "setup": {"layers": LAYERS, "hidden": 128, "intermediate": 1024, "per_device_batch": BATCH,
                  "max_length": MAX_LENGTH, "rounds": opts.rounds},
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    major = transformers.__version__.split(".")[0]
    path = RESULTS / ("plan_check.json" if major == "5" else f"plan_check_tf{major}.json")
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
