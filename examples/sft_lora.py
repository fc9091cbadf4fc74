"""SFT + LoRA on a tiny Llama built offline, with `SafeGCCallback`: prints every decision the plugin takes.

    python examples/sft_lora.py [--use-reentrant unset|true|false|"'false'"] [--mode strict|fix|warn]

Runs on CPU in seconds; no download.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile

import datasets
import transformers
import trl
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.testing import lm_dataset, make_model, make_tokenizer


def parse_reentrant(text: str):
    return {"unset": None, "true": True, "false": False}.get(text, text.strip("'\""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--use-reentrant", default="unset", help="unset, true, false, or a quoted string like 'false'")
    parser.add_argument("--mode", default=None, choices=["strict", "fix", "warn"])
    parser.add_argument("--output-dir", default=None)
    ns = parser.parse_args()

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("trl_gc_plugin").setLevel(logging.INFO)
    output_dir = ns.output_dir or tempfile.mkdtemp(prefix="trl-gc-demo-")
    value = parse_reentrant(ns.use_reentrant)
    kwargs = None if value is None else {"use_reentrant": value}

    print(f"transformers {transformers.__version__}, trl {trl.__version__}; gradient_checkpointing_kwargs={kwargs}")
    callback = SafeGCCallback(mode=ns.mode)
    args = SFTConfig(
        output_dir=output_dir, max_steps=5, per_device_train_batch_size=2, learning_rate=1e-3, max_length=32,
        gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    try:
        trainer = SFTTrainer(
            model=make_model(), args=args, train_dataset=lm_dataset(16), processing_class=make_tokenizer(),
            peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
            callbacks=[callback],
        )
    except GCConfigError as err:
        print(f"\nRefused before training:\n{err}")
        raise SystemExit(1) from None
    result = trainer.train()

    print("\nDecisions:")
    print(f"  {'stage':9} {'rule':34} {'action':8} {'setting':26} before -> after (set by)")
    for d in callback.decisions:
        print(f"  {d.stage:9} {d.rule_id:34} {d.action:8} {d.setting:26} {d.before!r} -> {d.after!r} ({d.source})")
    print(f"\nThe model trained with use_reentrant={model_use_reentrant(trainer.model)}; "
          f"final loss {result.training_loss:.3f}.")
    path = os.path.join(output_dir, "gc_decisions.json")
    with open(path) as fh:
        print(f"{len(json.load(fh))} decisions written to {path}")


if __name__ == "__main__":
    main()
