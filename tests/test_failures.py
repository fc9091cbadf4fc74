"""The failures the rules guard against, reproduced without the plugin, and gone with it."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from trainers import TF5, block_params, make_trainer, unchanged_block_params

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model.ckpt import model_use_reentrant
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

pytestmark = pytest.mark.skipif(TF5, reason="transformers >= 5.0 defaults to non-reentrant and hooks the inputs")


def frozen_embeddings():
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def lora_with_trainable_head():
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], lora_dropout=0.0)
    return get_peft_model(make_model(), config)


@pytest.mark.parametrize(("build", "n_block_params"), [(frozen_embeddings, 18), (lora_with_trainable_head, 8)])
def test_silent_zero_gradients_without_plugin_and_fixed_with_it(build, n_block_params, tmp_path):
    bare = make_trainer("trainer", build(), str(tmp_path / "bare"))
    before = block_params(bare.model)
    assert len(before) == n_block_params
    bare.train()  # trains "fine": loss goes down through the head, nothing warns loudly
    assert len(unchanged_block_params(bare.model, before)) == n_block_params  # 0 of n trained

    fixed = make_trainer("trainer", build(), str(tmp_path / "plugin"), callbacks=[SafeGCCallback()])
    before = block_params(fixed.model)
    fixed.train()
    assert unchanged_block_params(fixed.model, before) == []
    assert fixed.args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert model_use_reentrant(fixed.model) is False


def _grads(model, checkpointing_kwargs):
    tok = make_tokenizer()
    batch = tokenized_dataset(tok, n=2)[:2]
    batch = {k: torch.tensor(v) for k, v in batch.items()}
    model.train()
    if checkpointing_kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
    model(**batch).loss.backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters() if p.requires_grad}


def test_decided_gradients_equal_the_no_checkpointing_gradients(tmp_path):
    trainer = make_trainer("trainer", frozen_embeddings(), str(tmp_path), callbacks=[SafeGCCallback()])
    decided = trainer.args.gradient_checkpointing_kwargs
    reference = _grads(frozen_embeddings(), None)
    with_plugin = _grads(frozen_embeddings(), decided)
    legacy = _grads(frozen_embeddings(), {"use_reentrant": True})
    for name, ref in reference.items():
        assert torch.equal(with_plugin[name], ref), name
    assert all(legacy[n] is None for n in legacy if ".layers." in n)


def test_lora_alone_reentrant_crashes_without_plugin(tmp_path):
    model = get_peft_model(make_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with pytest.raises(RuntimeError, match="does not require grad"):
        make_trainer("trainer", model, str(tmp_path)).train()
