"""What SafeGCCallback costs (issue: runtime verification).

1. Per-step overhead on the tiny model, where it is most visible: median step time of a real Trainer run with the
   callback (audit and drift check on) vs without, interleaved repetitions, one process; step time measured between
   consecutive `on_step_end` events by a timer callback registered last. Also the bare cost of one `on_step_end`.
2. One-off cost of `on_init_end` (facts, decisions, apply, JSON), of setting up and removing the first-forward
   observation, and of the first-step gradient audit on a model with the parameter layout of a 7B Llama (hidden
   4096, 32 layers, vocab 32000) built on the `meta` device (no memory; gradients are meta tensors too, so the
   audit's finite-check reduction, one fused `_foreach_norm` on a real device, is not part of this figure).
3. What the first-forward observation adds to the one training step it watches: a forward+backward of the tiny
   model with the observation installed (and removed after) against one without, interleaved, medians.
4. What the parity probe costs on the modes benchmark's model (Llama hidden 512, 8 layers, vocab 8000; a training
   step at batch 4 x 512 tokens with reentrant checkpointing and AdamW), to decide whether it can run by default for
   reentrant runs: the probe is one forward/backward with and one without checkpointing on a 16-token sequence.

    .venv/bin/python benchmarks/callback_overhead.py [--steps 60] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model import verify
from trl_gc_plugin.model.hooks import Hooks
from trl_gc_plugin.model.observe import Observation
from trl_gc_plugin.runtime import parity
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def run(with_plugin: bool, steps: int, out: str) -> list[float]:
    timer = StepTimer()
    callbacks = ([SafeGCCallback(write_json=False)] if with_plugin else []) + [timer]
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2, use_cpu=True,
                             gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                             report_to="none", save_strategy="no", disable_tqdm=True, logging_strategy="no")
    trainer = Trainer(model=make_model(), args=args, train_dataset=tokenized_dataset(make_tokenizer(), n=64),
                      callbacks=callbacks)
    trainer.train()
    diffs = [b - a for a, b in zip(timer.stamps, timer.stamps[1:], strict=False)]
    return diffs[5:]  # warm-up steps out


def per_step(steps: int, repeats: int) -> dict[str, object]:
    medians: dict[str, list[float]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory() as out:
        run(True, 10, out)  # warm-up of both paths
        run(False, 10, out)
        for i in range(repeats):  # interleaved, the order reversed every repeat (the first of a pair runs slower)
            pairs = (("without", False), ("with", True))
            for name, flag in pairs if i % 2 == 0 else pairs[::-1]:
                medians[name].append(statistics.median(run(flag, steps, out)))
    without, with_ = statistics.median(medians["without"]), statistics.median(medians["with"])

    # the callback's own per-step work, timed directly
    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), gradient_checkpointing=True, report_to="none",
                             gradient_checkpointing_kwargs={"use_reentrant": False}, use_cpu=True)
    callback = SafeGCCallback(write_json=False)
    state, control = TrainerState(), TrainerControl()
    callback.on_init_end(args, state, control, model=model)
    callback.on_train_begin(args, state, control, model=model)
    assert callback._run.watch is not None and callback._run.watch._sentinel() is not None  # the real per-step path
    callback.on_step_end(args, state, control, model=model)  # the first step end removes the observation
    assert callback._run.first_forward is not None and callback._run.first_forward.observation is None

    def one_step() -> None:
        callback.on_step_begin(args, state, control, model=model)
        callback.on_step_end(args, state, control, model=model)

    n = 20000
    step_end_us = timeit.timeit(one_step, number=n) / n * 1e6
    return {
        "median_step_ms_without": round(without * 1e3, 3),
        "median_step_ms_with": round(with_ * 1e3, 3),
        "ratio_of_medians": round(with_ / without, 4),
        "per_repeat_median_ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in medians.items()},
        "on_step_begin_plus_end_us": round(step_end_us, 2),
        "per_step_share_of_step": round(step_end_us / (without * 1e6), 6),
    }


def first_forward(repeats: int) -> dict[str, object]:
    """The one training step the observation watches: forward+backward with it vs without (tiny model)."""
    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    tokenizer = make_tokenizer()
    batch = {k: torch.tensor(v) for k, v in tokenized_dataset(tokenizer, n=2)[:2].items()}

    def step(observe: bool) -> float:
        start = time.perf_counter()
        observation = Observation(model, Hooks(), lambda call: "report") if observe else None
        if observation is not None:
            observation.install()
        model(**batch).loss.backward()
        if observation is not None:
            observation.remove()
            assert len(observation.calls) == 2
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for _ in range(5):
        step(True), step(False)
    times: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(repeats):
        times["with"].append(step(True))
        times["without"].append(step(False))
    without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
    return {
        "median_step_ms_without": round(without * 1e3, 3),
        "median_step_ms_with_observation": round(with_ * 1e3, 3),
        "added_ms": round((with_ - without) * 1e3, 3),
        "repeats": repeats,
    }


def parity_cost(repeats: int) -> dict[str, object]:
    """The parity probe's one-off cost against one training step of the modes benchmark's model."""
    config = LlamaConfig(hidden_size=512, intermediate_size=512 * 8 // 3, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=8000, max_position_embeddings=512, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(config.vocab_size, (4, 512))

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def probe() -> float:
        start = time.perf_counter()
        result = parity.parity_probe(model)
        assert result.compared and result.ok, result
        return time.perf_counter() - start

    step(), probe()  # warm-up
    steps, probes = [], []
    for _ in range(repeats):
        steps.append(step())
        probes.append(probe())
    step_s, probe_s = statistics.median(steps), statistics.median(probes)
    return {
        "median_step_s": round(step_s, 3),
        "median_parity_probe_s": round(probe_s, 3),
        "probe_share_of_one_step": round(probe_s / step_s, 4),
        "repeats": repeats,
    }


def one_off_7b() -> dict[str, object]:
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), gradient_checkpointing=True, report_to="none",
                             use_cpu=True)
    callback = SafeGCCallback()
    start = time.perf_counter()
    callback.on_init_end(args, TrainerState(), TrainerControl(), model=model)
    init_end = time.perf_counter() - start

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    start = time.perf_counter()
    observation = Observation(model, Hooks(), lambda call: "report")
    stacks = observation.install()
    observation.remove()
    observe = time.perf_counter() - start
    assert stacks == 1
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    start = time.perf_counter()
    result = verify.audit_gradients(model)
    audit = time.perf_counter() - start
    assert result.ok and result.checked == 32
    return {
        "parameters": n_params,
        "on_init_end_ms": round(init_end * 1e3, 2),
        "observation_install_remove_ms": round(observe * 1e3, 2),
        "audit_ms": round(audit * 1e3, 2),
        "total_ms": round((init_end + observe + audit) * 1e3, 2),
        "decisions": [d.line() for d in callback.decisions],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "callback_overhead.json"))
    ns = parser.parse_args()
    logging.getLogger("trl_gc_plugin").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    result = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "per_step_tiny_model": per_step(ns.steps, ns.repeats),
        "first_forward_observation_tiny_model": first_forward(ns.repeats * 20),
        "one_off_7b_meta": one_off_7b(),
        "parity_probe_benchmark_model": parity_cost(max(3, ns.repeats)),
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
