"""Run under `torchrun --nproc_per_node 2`: one or more DDP training scenarios on the tiny model (gloo, CPU).

    torchrun --nproc_per_node 2 tests/ddp_scenarios.py OUTDIR SCENARIO [SCENARIO ...]

A scenario is `<model>-<use_reentrant>-<find_unused>-<plugin>`: model `full`, `lora`, `lorahook` (LoRA with
`enable_input_require_grads()`, as TRL prepares it), `unused` (the full model with a trainable module the loss never
reaches, as an unfrozen vision tower a text batch does not use), or `unusedoff` (the same, checkpointing off); use_reentrant `unset`,
`true` or `false`; find_unused `unset`, `true` or `false`; plugin `none`, `strict`, `fix`, `warn`, or `installed`
(`trl_gc_plugin.installed()` around building the arguments and the trainer, strict mode). Each rank
appends one JSON line per scenario to `OUTDIR/results-rank<R>.jsonl` (not stdout, where the ranks interleave): the outcome (`trained`, or the exception type and first
line), the effective use_reentrant, and a checksum of the trainable parameters of every rank (to show they stayed
in sync).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torchrun import write_results
from transformers import Trainer, TrainingArguments

from trl_gc_plugin import SafeGCCallback, installed
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

FLAG = {"unset": None, "true": True, "false": False}


def run(out: str, scenario: str) -> dict:
    model_kind, reentrant, unused, plugin = scenario.split("-")
    model = make_model()
    if model_kind in ("lora", "lorahook"):
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    if model_kind == "lorahook":
        model.enable_input_require_grads()
    if model_kind in ("unused", "unusedoff"):
        model.model.unused_tower = torch.nn.Linear(8, 8)
    kwargs = None if FLAG[reentrant] is None else {"use_reentrant": FLAG[reentrant]}
    callbacks = [] if plugin in ("none", "installed") else [SafeGCCallback(mode=plugin)]
    result: dict = {"scenario": scenario, "rank": int(os.environ.get("RANK", "0"))}
    scope = installed("strict") if plugin == "installed" else contextlib.nullcontext()
    trainer = None
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    try:
        with scope:
            result["where"] = "TrainingArguments"
            args = TrainingArguments(
                output_dir=os.path.join(out, scenario), max_steps=2, per_device_train_batch_size=2,
                learning_rate=1e-2, use_cpu=True, ddp_backend="gloo", report_to="none", save_strategy="no",
                disable_tqdm=True, gradient_checkpointing=model_kind != "unusedoff", gradient_checkpointing_kwargs=kwargs,
                ddp_find_unused_parameters=FLAG[unused],
            )
            result["where"] = "Trainer"
            trainer = Trainer(model=model, args=args, train_dataset=tokenized_dataset(make_tokenizer()),
                              callbacks=callbacks)
            result["where"] = "train"
            trainer.train()
        result["outcome"] = "trained"
    except Exception as exc:  # reported, not raised: the test reads the outcome
        result["outcome"] = f"{type(exc).__name__}: {' '.join(str(exc).splitlines()[:2])[:300]}"
        trainer = None
    result["unchanged"] = all(torch.equal(a, p.detach()) for a, p in zip(before, (p for p in model.parameters()
                                                                                if p.requires_grad), strict=True))
    result["running"] = model_use_reentrant(model)
    if callbacks:
        result["decisions"] = [[d.rule_id, d.action] for d in callbacks[0].decisions]
    if trainer is not None and dist.is_initialized():
        total = torch.stack([p.detach().double().sum() for p in model.parameters() if p.requires_grad]).sum()
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, total.reshape(1))
        result["checksums"] = [float(g) for g in gathered]
    return result


def main() -> None:
    out, scenarios = sys.argv[1], sys.argv[2:]
    write_results(out, scenarios, run)


if __name__ == "__main__":
    main()
