"""What the parity probe costs on the first step of a real full fine-tune: memory above the model and time.

A 134M-parameter Llama (hidden 768, 12 layers, vocab 32000) in float32, full fine-tune, reentrant checkpointing,
AdamW, one `Trainer` step of batch 4 x 512 tokens (the modes benchmark's batch), on the CPU (or CUDA when present, in bf16 on a >=1B model with
`--cuda-1b`). Each configuration runs in its own process: CPU peak = the process's max RSS (`ru_maxrss`) less the
RSS after the model was built ("above the model": gradients, optimizer state, activations, the probe); CUDA peak =
`max_memory_allocated` less the memory allocated after the model was placed. Configurations:

- `without`: no plugin (checkpointing as asked);
- `with`: `SafeGCCallback(parity_check=True)` (the probe runs at the first optimizer step, before the update).

Writes benchmarks/results/parity_memory.json. Run: `python benchmarks/parity_memory.py` (3-4 minutes on 2 cores).
Pass `--plugin-path DIR` to measure another checkout of the plugin (e.g. the release before the bounded probe).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "parity_memory.json"


def child(config: str, cuda_1b: bool) -> dict[str, object]:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    if cuda_1b:  # a Llama-3.2-1B-shaped model
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256)
    else:
        shape = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                     num_key_value_heads=12, vocab_size=32000)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1024, use_cache=False, **shape))
    if cuda:
        model = model.to("cuda", torch.bfloat16 if cuda_1b else torch.float32)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n_params = sum(p.numel() for p in model.parameters())
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(shape["vocab_size"], (4, 512))]
    callbacks = []
    probe_seconds: list[float] = []
    if config == "with":
        from trl_gc_plugin import SafeGCCallback
        from trl_gc_plugin.routes import callback

        try:  # this checkout: the runtime checks call parity.parity_probe
            from trl_gc_plugin.runtime import first_step

            timed = first_step.parity
        except ImportError:  # an older checkout (--plugin-path): the callback called it
            timed = getattr(callback, "parity", None) or callback.verify
        original = timed.parity_probe

        def parity_probe(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                probe_seconds.append(time.perf_counter() - start)

        timed.parity_probe = parity_probe
        callbacks.append(SafeGCCallback(parity_check=True))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=4, learning_rate=1e-5,
                                 gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True},
                                 report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                 use_cpu=not cuda, bf16=cuda_1b)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        start = time.perf_counter()
        trainer.train()
        step_s = time.perf_counter() - start
        decisions = [d for c in callbacks for d in c.decisions if d.rule_id == "parity-check"]
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "config": config,
        "device": "cuda" if cuda else "cpu",
        "parameters": n_params,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "base_bytes": base,
        "peak_bytes": peak,
        "above_model_bytes": peak - base,
        "first_step_s": round(step_s, 3),
        "probe_s": round(sum(probe_seconds), 3) if probe_seconds else None,
        "parity": [d.reason for d in decisions],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--plugin-path", help="import trl_gc_plugin from this directory instead")
    parser.add_argument("--cuda-1b", action="store_true", help="a 1B bf16 model on CUDA instead of the 134M one")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--child", choices=["with", "without"], help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps(child(ns.child, ns.cuda_1b)))
        return
    env = dict(os.environ, TRL_GC_PLUGIN="0")
    if ns.plugin_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [ns.plugin_path, env.get("PYTHONPATH")]))
    runs = []
    for round_ in range(ns.rounds):
        for config in (("without", "with") if round_ % 2 == 0 else ("with", "without")):
            cmd = [sys.executable, __file__, "--child", config] + (["--cuda-1b"] if ns.cuda_1b else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            run["round"] = round_
            runs.append(run)
            print(f"{config:8s} above the model {run['above_model_bytes'] / 2**30:.3f} GiB, first step "
                  f"{run['first_step_s']:.2f} s, probe {run['probe_s']} s", flush=True)
    with_ = [r for r in runs if r["config"] == "with"]
    without = [r for r in runs if r["config"] == "without"]
    ratio = max(w["above_model_bytes"] for w in with_) / min(w["above_model_bytes"] for w in without)
    share = max(w["probe_s"] / w["first_step_s"] for w in with_ if w["probe_s"] is not None)
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "plugin_path": ns.plugin_path or "this checkout",
        "runs": runs,
        "peak_above_model_ratio_with_over_without_worst": round(ratio, 4),
        "probe_share_of_first_step_worst": round(share, 4),
    }
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"ratio {ratio:.4f} (target <= 1.03), probe share of the first step {share:.3f} (target <= 0.15)")


if __name__ == "__main__":
    main()
