"""The model route's cost in a training loop without a Trainer (issue 27), and what checkpointing buys there.

A plain PyTorch loop on a Llama-shaped model (CPU, fp32, one thread): no checkpointing, checkpointing without the
plugin, checkpointing with `trl_gc_plugin.guard()` (the plugin deciding; the first step's checks run, then every hook
goes). Measured: the activation bytes the forward saves for the backward (saved-tensor hooks, every saved tensor's
storage counted once), the median step time of steps 2..N (main-thread CPU time, the three arms interleaved), and the
first step's time with the plugin (its one-off checks). The training-memory cut adds the weights, gradients and
AdamW's two moments (4 x the float32 weights) to both sides. Writes `benchmarks/results/loop_route.json`.

    python benchmarks/loop_route.py [--steps 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import trl_gc_plugin

torch.set_num_threads(1)
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4)
BATCH, SEQ = 4, 256


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).train()


def saved_bytes(model: LlamaForCausalLM, ids: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def arm(kind: str) -> tuple[LlamaForCausalLM, torch.optim.Optimizer]:
    model = build()
    if kind != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if kind == "plugin":
        trl_gc_plugin.guard(model, mode="strict")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: LlamaForCausalLM, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    start = time.process_time()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    kinds = ("none", "gc", "plugin")
    weights = sum(p.numel() * p.element_size() for p in build().parameters())
    static = 4 * weights  # weights, gradients and AdamW's two moments, all float32
    memory = {}
    for kind in kinds:
        model, _ = arm(kind)
        memory[kind] = saved_bytes(model, ids) if kind != "plugin" else None
    times: dict[str, list[float]] = {k: [] for k in kinds}
    first: list[float] = []
    first_gc: list[float] = []
    for _ in range(ns.rounds):
        arms = {k: arm(k) for k in kinds}
        first.append(step(*arms["plugin"], ids))
        first_gc.append(step(*arms["gc"], ids))
        step(*arms["none"], ids)
        for _ in range(ns.steps - 1):
            for k in kinds:
                times[k].append(step(*arms[k], ids))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": {**CONFIG, "batch": BATCH, "seq": SEQ, "dtype": "float32", "device": "cpu", "threads": 1},
        "torch": torch.__version__,
        "saved_activation_bytes": {"no_checkpointing": memory["none"], "checkpointing": memory["gc"]},
        "activation_memory_cut": round(1 - memory["gc"] / memory["none"], 3),
        "static_bytes": static,
        "training_memory_cut": round(1 - (static + memory["gc"]) / (static + memory["none"]), 3),
        "median_step_s": {k: round(v, 4) for k, v in med.items()},
        "checkpointing_time_cost": round(med["gc"] / med["none"] - 1, 3),
        "plugin_cost_after_first_step": round(med["plugin"] / med["gc"] - 1, 4),
        "plugin_first_step_s": round(statistics.median(first), 4),
        "checkpointing_first_step_s": round(statistics.median(first_gc), 4),
        "steps": ns.steps, "rounds": ns.rounds,
    }
    out = Path(__file__).with_name("results") / "loop_route.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
