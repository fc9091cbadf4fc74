"""Reproduce the ZeRO-3 + frozen parameters + non-reentrant `CheckpointError` on a DeepSpeed release older than the
fix (PR 8148, first in 0.19.3), and show what the plugin does there and on a fixed release.

Slow (builds a venv with the old DeepSpeed, compiles DeepSpeed's CPU ops on first use, runs 2-process ZeRO-3 on
CPU), so it lives here rather than in the test suite.

    .venv/bin/python benchmarks/zero3_old_deepspeed.py [--old 0.19.2]

For each DeepSpeed (the old one, in a venv that otherwise sees this environment's packages, and the installed one)
it launches `torchrun --nproc_per_node 2` (gloo, `DS_ACCELERATOR=cpu`) over three scenarios: LoRA (with the input
hook, as TRL prepares it) + checkpointing and use_reentrant=False without the plugin; use_reentrant unset with the
plugin (strict); use_reentrant=False with the plugin (strict). Results: benchmarks/results/zero3_old_deepspeed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("bare-false", "plugin-unset", "plugin-false")
ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1000,
                          "stage3_prefetch_bucket_size": 1000},
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "zero_force_ds_cpu_optimizer": False,
}


def gloo_for_deepspeed_on_cpu() -> None:
    """Without a GPU, accelerate picks no process-group backend when DeepSpeed is on, and every rank believes it
    is alone. Give it gloo (benchmark-only workaround, as recorded in shared/upstream-facts.md)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if chosen is None and os.environ.get("LOCAL_RANK") and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            return "gloo", DistributedType.MULTI_CPU
        return chosen, kind

    PartialState._prepare_backend = prepare


def worker(out: str) -> None:
    import deepspeed
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from trl_gc_plugin import SafeGCCallback
    from trl_gc_plugin.model.ckpt import model_use_reentrant
    from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

    gloo_for_deepspeed_on_cpu()
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for scenario in SCENARIOS:
        plugin, reentrant = scenario.split("-")
        model = get_peft_model(make_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        model.enable_input_require_grads()
        kwargs = None if reentrant == "unset" else {"use_reentrant": reentrant == "true"}
        callbacks = [SafeGCCallback()] if plugin == "plugin" else []
        result = {"scenario": scenario, "rank": rank, "deepspeed": deepspeed.__version__}
        try:
            args = TrainingArguments(output_dir=os.path.join(out, scenario), deepspeed=ZERO3, max_steps=2,
                                     per_device_train_batch_size=2, learning_rate=1e-2, report_to="none",
                                     save_strategy="no", disable_tqdm=True, gradient_checkpointing=True,
                                     gradient_checkpointing_kwargs=kwargs)
            trainer = Trainer(model=model, args=args, train_dataset=tokenized_dataset(make_tokenizer()),
                              callbacks=callbacks)
            trainer.train()
            result["outcome"] = "trained"
        except Exception as exc:
            result["outcome"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}"
        result["running"] = model_use_reentrant(model)
        if callbacks:
            result["decisions"] = [[d.rule_id, d.action, repr(d.after)] for d in callbacks[0].decisions]
        results.append(result)
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
    Path(out, f"rank{rank}.json").write_text(json.dumps(results, indent=2))


def launch(python: str, env: dict[str, str], out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29591",
                           __file__, "--worker", str(out)], env=env, capture_output=True, text=True, timeout=1800)
    files = sorted(out.glob("rank*.json"))
    if not files:
        raise SystemExit(f"no results ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [r for f in files for r in json.loads(f.read_text())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="0.19.2")
    parser.add_argument("--worker", metavar="OUT")
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.worker)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from startup_env import make_venv

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        old = make_venv(Path(tmp) / "old-deepspeed", None)
        subprocess.run([sys.executable, "-m", "pip", "--python", str(old), "install", "-q", "--no-deps",
                        f"deepspeed=={ns.old}"], check=True)
        for label, python in ((f"deepspeed {ns.old}", str(old)), ("installed deepspeed", sys.executable)):
            report[label] = launch(python, env, Path(tmp) / label.replace(" ", "_"))
            for r in report[label]:
                print(f"{label:22} rank {r['rank']} {r['scenario']:13} {r['outcome'][:110]} "
                      f"(running use_reentrant={r['running']})", flush=True)
    out = ROOT / "benchmarks" / "results" / "zero3_old_deepspeed.json"
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
