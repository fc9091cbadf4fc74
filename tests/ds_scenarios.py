"""Run under `torchrun --nproc_per_node 1` with `DS_ACCELERATOR=cpu`: TRL's SFTTrainer + LoRA (`peft_config`) +
DeepSpeed ZeRO-3, checkpointing on and `use_reentrant` unset, without and with the plugin.

    torchrun --nproc_per_node 1 tests/ds_scenarios.py OUTDIR none|strict [...]

Appends one JSON line per scenario to OUTDIR/results.jsonl: the outcome, both kwargs fields after the trainer's
`__init__`, the `use_reentrant` the model runs, whether the LoRA weights inside the layers changed, the decisions.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from peft import LoraConfig
from torchrun import finish
from trl import SFTConfig, SFTTrainer

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.testing import lm_dataset, make_model, make_tokenizer

ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1000,
                          "stage3_prefetch_bucket_size": 1000},
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "zero_force_ds_cpu_optimizer": False,
    # DeepSpeed's own activation checkpointing: never applied to a Hugging Face model (recorded below)
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
}


def run(out: str, plugin: str) -> dict:
    args = SFTConfig(output_dir=os.path.join(out, plugin), deepspeed=ZERO3, max_steps=2, per_device_train_batch_size=2,
                     learning_rate=1e-2, max_length=32, bf16=False, report_to="none", save_strategy="no",
                     disable_tqdm=True, gradient_checkpointing=True)
    callbacks = [] if plugin == "none" else [SafeGCCallback(mode=plugin)]
    trainer = SFTTrainer(model=make_model(), args=args, train_dataset=lm_dataset(), processing_class=make_tokenizer(),
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
                         callbacks=callbacks)
    result = {
        "plugin": plugin,
        "gradient_checkpointing_kwargs": args.gradient_checkpointing_kwargs,
        "activation_checkpointing_kwargs": getattr(args, "activation_checkpointing_kwargs", "n/a"),
        "zero_stage": args.deepspeed_plugin.zero_stage if args.deepspeed_plugin else None,
    }
    import deepspeed

    lora = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad and ".layers." in n}
    with deepspeed.zero.GatheredParameters(list(lora.values())):
        before = {n: p.detach().clone() for n, p in lora.items()}
    try:
        trainer.train()
        result["outcome"] = "trained"
    except Exception as exc:
        result["outcome"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    with deepspeed.zero.GatheredParameters(list(lora.values())):
        result["lora_changed"] = sum(not torch.equal(p.detach(), before[n]) for n, p in lora.items())
    result["lora_total"] = len(lora)
    result["deepspeed_checkpointing_configured"] = deepspeed.checkpointing.is_configured()
    result["running"] = model_use_reentrant(trainer.model)
    if callbacks:
        result["decisions"] = [[d.rule_id, d.action, repr(d.after)] for d in callbacks[0].decisions]
    return result


def main() -> None:
    out = sys.argv[1]
    with open(os.path.join(out, "results.jsonl"), "a", encoding="utf-8") as fh:
        for plugin in sys.argv[2:]:
            fh.write(json.dumps(run(out, plugin), default=repr) + "\n")
            fh.flush()
    finish()


if __name__ == "__main__":
    main()
