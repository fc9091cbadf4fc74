"""DPO and GRPO (the trainers that switch checkpointing off and on every step) on a tiny Llama, offline, with the
plugin installed globally via `trl_gc_plugin.install()` rather than passed as a callback.

    python examples/dpo_grpo.py
"""

from __future__ import annotations

import logging
import tempfile

import datasets
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

import trl_gc_plugin
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.testing import make_model, make_tokenizer, preference_dataset, prompt_dataset

COMMON = dict(max_steps=3, per_device_train_batch_size=2, use_cpu=True, bf16=False, report_to="none",
              save_strategy="no", logging_steps=1, disable_tqdm=True, gradient_checkpointing=True)


def reward_length(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def main() -> None:
    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("trl_gc_plugin").setLevel(logging.INFO)
    with trl_gc_plugin.installed():  # patches __post_init__ and registers the callback; undone at the end
        dpo = DPOTrainer(model=make_model(), ref_model=make_model(), processing_class=make_tokenizer(),
                         args=DPOConfig(output_dir=tempfile.mkdtemp(), max_length=32, **COMMON),
                         train_dataset=preference_dataset())
        dpo.train()
        print(f"DPO trained with use_reentrant={model_use_reentrant(dpo.model)}; "
              f"args: {dpo.args.gradient_checkpointing_kwargs}")
        grpo = GRPOTrainer(model=make_model(), reward_funcs=reward_length, processing_class=make_tokenizer(),
                           args=GRPOConfig(output_dir=tempfile.mkdtemp(), num_generations=2, max_completion_length=6,
                                           **COMMON),
                           train_dataset=prompt_dataset())
        grpo.train()
        print(f"GRPO trained with use_reentrant={model_use_reentrant(grpo.model)}; "
              f"args: {grpo.args.gradient_checkpointing_kwargs}")


if __name__ == "__main__":
    main()
