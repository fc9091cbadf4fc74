"""Run under `torchrun --nproc_per_node 1` with `DS_ACCELERATOR=cpu`: a tiny Llama whose decoder layers torch's
`apply_activation_checkpointing` wraps (as Axolotl's activation offloading does on a full fine-tune), trained one step
by the Trainer and saved with `save_model`, under DeepSpeed ZeRO-3 or without it, without and with the plugin.

    torchrun --nproc_per_node 1 tests/wrapper_scenarios.py OUTDIR zero3-none zero3-strict plain-strict

Appends one JSON line per scenario to OUTDIR/results.jsonl: the outcome, the saved keys that hold
`_checkpoint_wrapped_module`, the saved keys, the decisions.
"""

from __future__ import annotations

import json
import os
import sys

from safetensors import safe_open
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torchrun import finish
from transformers import Trainer, TrainingArguments
from transformers.modeling_layers import GradientCheckpointingLayer

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1000,
                          "stage3_prefetch_bucket_size": 1000, "stage3_gather_16bit_weights_on_model_save": True},
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "zero_force_ds_cpu_optimizer": False,
}


def run(out: str, scenario: str) -> dict:
    launch, plugin = scenario.split("-")
    where = os.path.join(out, scenario)
    model = make_model()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, GradientCheckpointingLayer))
    args = TrainingArguments(output_dir=where, max_steps=1, per_device_train_batch_size=2, report_to="none",
                             save_strategy="no", disable_tqdm=True, bf16=False,
                             deepspeed=ZERO3 if launch == "zero3" else None)
    callbacks = [] if plugin == "none" else [SafeGCCallback(mode=plugin)]
    result: dict = {"scenario": scenario}
    try:
        trainer = Trainer(model=model, args=args, train_dataset=tokenized_dataset(make_tokenizer()),
                          callbacks=callbacks)
        trainer.train()
        trainer.save_model(where)
        result["outcome"] = "trained"
    except Exception as exc:
        result["outcome"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return result
    keys: list[str] = []
    for name in sorted(f for f in os.listdir(where) if f.endswith(".safetensors")):
        with safe_open(os.path.join(where, name), "pt") as fh:
            keys += list(fh.keys())
    result["keys"] = len(keys)
    result["wrapped_keys"] = sum("_checkpoint_wrapped_module" in k for k in keys)
    if callbacks:
        result["decisions"] = [[d.rule_id, d.action, d.level] for d in callbacks[0].decisions]
    return result


def main() -> None:
    out = sys.argv[1]
    with open(os.path.join(out, "results.jsonl"), "a", encoding="utf-8") as fh:
        for scenario in sys.argv[2:]:
            fh.write(json.dumps(run(out, scenario), default=repr) + "\n")
            fh.flush()
    finish()


if __name__ == "__main__":
    main()
