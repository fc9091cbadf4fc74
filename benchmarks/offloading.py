"""Activation offloading on the device (issue 38): one training step of a Llama-shaped model without checkpointing,
with full checkpointing, with transformers' own `offload` (`gradient_checkpointing_kwargs={"offload": True}`, where
the installed transformers has it) and with TRL's `activation_offloading` (where TRL is installed), each with and
without the plugin (`SafeGCCallback`): the step's peak memory above the model, its wall time, and how the run ended.
Each configuration runs in its own process (a clean allocator), three steps, the last one timed.

    python benchmarks/offloading.py [--device cuda] [--hidden 2048 --layers 8 --seq 2048 --batch 2]

On a CPU (`--device cpu`, a smaller default shape) only the configurations that run without an accelerator are
measured: the others are recorded as skipped, with why. Writes benchmarks/results/offloading[_cuda].json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
CONFIGS = ("none", "full", "offload", "trl_offloading")


def child(config: str, plugin: bool, ns: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    device = torch.device(ns.device)
    cfg = LlamaConfig(hidden_size=ns.hidden, intermediate_size=ns.hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=ns.layers, num_attention_heads=ns.hidden // 128 or 1,
                      num_key_value_heads=ns.hidden // 128 or 1, vocab_size=32000, max_position_embeddings=ns.seq)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    ids = torch.randint(3, 32000, (ns.batch, ns.seq), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": ids[i].tolist(), "labels": ids[i].tolist()} for i in range(ns.batch)]

    def collate(items):
        return {k: torch.tensor([r[k] for r in items]) for k in ("input_ids", "labels")}

    kwargs = {"use_reentrant": False, **({"offload": True} if config == "offload" else {})}
    common = dict(output_dir="/tmp/offloading-bench", max_steps=3, per_device_train_batch_size=ns.batch,
                  report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
                  use_cpu=device.type == "cpu", gradient_checkpointing=config != "none",
                  gradient_checkpointing_kwargs=kwargs if config != "none" else None, bf16=device.type == "cuda",
                  remove_unused_columns=False)
    callbacks = []
    if plugin:
        from trl_gc_plugin import SafeGCCallback

        callbacks.append(SafeGCCallback(mode="warn"))
    if config == "trl_offloading":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common, activation_offloading=True, max_length=ns.seq)
        trainer = SFTTrainer(model=model, args=args, train_dataset=_Rows(rows), data_collator=collate,
                             callbacks=callbacks or None)
    else:
        args = TrainingArguments(**common)
        trainer = Trainer(model=model, args=args, train_dataset=_Rows(rows), data_collator=collate,
                          callbacks=callbacks or None)
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    times: list[float] = []

    class Timer:  # a TrainerCallback by duck typing: the step's wall time, synchronised
        def __getattr__(self, name):
            return lambda *a, **k: None

        def on_step_begin(self, *a, **k):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    trainer.add_callback(Timer())
    trainer.train()
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    return {"config": config, "plugin": plugin, "last_step_s": round(times[-1], 4), "peak_above_model_bytes": peak}


class _Rows:
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        return self.rows[i % len(self.rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per configuration")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    gpu = ns.device == "cuda"
    ns.hidden = ns.hidden or (2048 if gpu else 256)
    ns.layers = ns.layers or (8 if gpu else 2)
    ns.seq = ns.seq or (2048 if gpu else 128)
    if ns.child:
        print(json.dumps(child(ns.child[0], ns.child[1] == "with", ns)))
        return
    import torch

    result = {"python": platform.python_version(), "torch": torch.__version__, "device": ns.device,
              "gpu": torch.cuda.get_device_name() if gpu and torch.cuda.is_available() else None,
              "shape": {"hidden": ns.hidden, "layers": ns.layers, "seq": ns.seq, "batch": ns.batch}, "runs": []}
    for config in CONFIGS:
        for plugin in ("without", "with"):
            run = {"config": config, "plugin": plugin == "with"}
            why = _skip(config, gpu)
            if why:
                run["skipped"] = why
                result["runs"].append(run)
                continue
            cmd = [sys.executable, __file__, "--device", ns.device, "--hidden", str(ns.hidden), "--layers",
                   str(ns.layers), "--seq", str(ns.seq), "--batch", str(ns.batch), "--child", config, plugin]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ns.timeout,
                                      env=dict(os.environ, TRL_GC_PLUGIN="0"))
            except subprocess.TimeoutExpired:
                run["error"] = f"timed out after {ns.timeout} s"
            else:
                lines = proc.stdout.strip().splitlines()
                if proc.returncode == 0 and lines:
                    run.update(json.loads(lines[-1]))
                else:
                    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
                    run["error"] = tail[-1][:300] if tail else f"exit code {proc.returncode}"
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("offloading_cuda.json" if gpu else "offloading.json")).write_text(json.dumps(result, indent=2) + "\n")


def _skip(config: str, gpu: bool) -> str:
    import importlib.util

    if config == "trl_offloading" and importlib.util.find_spec("trl") is None:
        return "TRL is not installed here"
    if config == "trl_offloading" and not gpu:
        return "TRL's offloading needs an accelerator (rule activation-offloading-needs-accelerator)"
    if config == "offload":
        from trl_gc_plugin.core import capabilities
        from trl_gc_plugin.model import probe

        if not capabilities.installed().offload:
            return "this transformers has no offload"
        if not probe.accelerator_built():
            return "torch without an accelerator backend: offload's pin_memory fails (rule offload-needs-accelerator)"
    return ""


if __name__ == "__main__":
    main()
