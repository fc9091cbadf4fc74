"""Tiny, offline building blocks for tests, examples and benchmarks: an in-memory BPE tokenizer, a 2-layer Llama and
small datasets. Not imported by `trl_gc_plugin` itself; needs `datasets` and `tokenizers` (both come with TRL).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "gradient checkpointing trades compute for memory",
    "reentrant and non reentrant checkpoints differ",
    "a tiny model trains on a tiny corpus",
] * 4

PROMPTS = ["the quick", "gradient", "a tiny", "reentrant"]


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok.to_str()


def make_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


def make_config(tokenizer: PreTrainedTokenizerFast | None = None, **overrides: Any) -> LlamaConfig:
    tokenizer = tokenizer or make_tokenizer()
    defaults: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**(defaults | overrides))


def make_model(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(make_config(**overrides)).float()


def lm_dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict({"text": [CORPUS[i % len(CORPUS)] for i in range(n)]})


def tokenized_dataset(tokenizer: PreTrainedTokenizerFast, n: int = 8) -> Dataset:
    enc = tokenizer([CORPUS[i % len(CORPUS)] for i in range(n)], padding="max_length", max_length=16, truncation=True)
    labels = [
        [t if m else -100 for t, m in zip(ids, mask, strict=True)]
        for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)
    ]
    return Dataset.from_dict({**enc, "labels": labels})


def preference_dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)],
            "chosen": [" jumps over the lazy dog"] * n,
            "rejected": [" memory compute trades"] * n,
        }
    )


def prompt_dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)]})
