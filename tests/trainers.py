"""Build real trainers (Trainer, SFT, DPO, GRPO) on the tiny model, for every model variant the tests use."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version

from trl_gc_plugin.testing import (
    lm_dataset,
    make_model,
    make_tokenizer,
    preference_dataset,
    prompt_dataset,
    tokenized_dataset,
)

TF_VERSION = Version(transformers.__version__)
TF5 = Version("5.0.0") <= TF_VERSION
HAS_ACTIVATION_FIELDS = "activation_checkpointing_kwargs" in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
TRAINERS = ("trainer", "sft", "dpo", "grpo")
VARIANTS = ("full", "lora", "frozen_emb", "qlora")
LORA_TARGETS = ["q_proj", "v_proj"]

try:
    import trl

    TRL_VERSION = Version(trl.__version__)
except ImportError:  # pragma: no cover
    trl = None
    TRL_VERSION = Version("0")


def common_args(output_dir: str, **extra: Any) -> dict[str, Any]:
    kwargs = dict(
        output_dir=output_dir,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        seed=0,
    )
    kwargs.update(extra)
    return kwargs


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")


def load_4bit(checkpoint: str):
    import pytest

    pytest.importorskip("bitsandbytes", reason="bitsandbytes (the `test` extra) is not installed: no 4-bit model")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=qconfig, device_map="cpu")


def build_model(variant: str, kind: str, checkpoint: str | None = None):
    """(model, peft_config): TRL trainers get a `peft_config` (their usual path); the plain Trainer gets a PeftModel."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    if variant == "full":
        return make_model(), None
    if variant == "frozen_emb":
        model = make_model()
        model.get_input_embeddings().weight.requires_grad_(False)
        return model, None
    if variant == "lora":
        model = make_model()
    elif variant == "qlora":
        assert checkpoint is not None
        model = load_4bit(checkpoint)
        if kind == "trainer":
            # what PEFT's docs tell plain-Trainer users to do; with default kwargs it adds the input-grad hook
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        raise ValueError(variant)
    if kind == "trainer":
        return get_peft_model(model, lora_config()), None
    return model, lora_config()


def gc_kwargs_for(use_reentrant: Any) -> dict[str, Any] | None:
    return None if use_reentrant == "unset" else {"use_reentrant": use_reentrant}


def make_trainer(kind: str, model, output_dir: str, gc: bool = True, gc_kwargs: dict | None = None,
                 callbacks: list | None = None, peft_config=None, max_steps: int = 3, **overrides: Any):
    """A real trainer of `kind` on the tiny datasets, with checkpointing `gc` and `gc_kwargs` (and `overrides` of
    the common arguments, e.g. `save_strategy`)."""
    tokenizer = make_tokenizer()
    max_length = overrides.pop("max_length", 32)  # SFT and DPO
    gc_fields = dict(gradient_checkpointing=gc, gradient_checkpointing_kwargs=gc_kwargs, **overrides)
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(**common_args(output_dir, max_steps=max_steps, **gc_fields))
        return Trainer(model=model, args=args, train_dataset=tokenized_dataset(tokenizer), callbacks=callbacks)
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common_args(output_dir, max_steps=max_steps, max_length=max_length, **gc_fields))
        return SFTTrainer(model=model, args=args, train_dataset=lm_dataset(), processing_class=tokenizer,
                          callbacks=callbacks, peft_config=peft_config)
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common_args(output_dir, max_steps=max_steps, max_length=max_length, **gc_fields))
        ref = None if (peft_config is not None or _is_peft(model)) else make_model()
        return DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=preference_dataset(),
                          processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    if kind == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        extra: dict[str, Any] = dict(num_generations=2, max_completion_length=6, per_device_train_batch_size=2)
        if "use_vllm" in inspect.signature(GRPOConfig).parameters:
            extra["use_vllm"] = False
        args = GRPOConfig(**common_args(output_dir, max_steps=max_steps, **gc_fields, **{k: v for k, v in extra.items()
                                                                                             if k != "per_device_train_batch_size"}))
        return GRPOTrainer(model=model, reward_funcs=_reward_len, args=args, train_dataset=prompt_dataset(),
                           processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    raise ValueError(kind)


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def _reward_len(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


def block_params(model) -> dict[str, torch.Tensor]:
    """Trainable parameters that live inside the checkpointed decoder layers, detached copies."""
    return {n: p.detach().clone().float() for n, p in model.named_parameters() if p.requires_grad and ".layers." in n}


def unchanged_block_params(model, before: dict[str, torch.Tensor]) -> list[str]:
    after = dict(model.named_parameters())
    return [n for n, old in before.items() if torch.equal(after[n].detach().float(), old)]
