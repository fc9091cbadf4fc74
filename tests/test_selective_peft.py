"""Selective per-op checkpointing with PEFT adapters (issue 26, item 4): the memory planner's selective candidate keeps
matmul outputs; a LoRA variant that changes a base layer's output in place invalidates what was kept. Measured here
with the plugin's own selective policy (`ckpt.Spec(layout=...)` with selective blocks), against no checkpointing: plain LoRA and DoRA are
exact; BD-LoRA is 0.55-0.59 off and aLoRA (with its invocation token in the batch) 1.61 off, silently. The planner leaves
the selective candidate out for adapters it is not known to be exact for, and says so."""

from __future__ import annotations

import pytest
import torch

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.core.layout import Layout
from trl_gc_plugin.model import ckpt, probe
from trl_gc_plugin.model.ckpt import is_selective
from trl_gc_plugin.testing import make_model

peft = pytest.importorskip("peft")


def variant_config(kind: str):
    from peft import LoraConfig

    extra: dict = {}
    if kind == "dora":
        extra = {"use_dora": True}
    elif kind == "alora":
        extra = {"alora_invocation_tokens": [5]}
    elif kind == "bdlora":
        config = pytest.importorskip("peft.tuners.lora.config")
        if not hasattr(config, "BdLoraConfig"):
            pytest.skip("this PEFT has no BD-LoRA")
        extra = {"use_bdlora": config.BdLoraConfig(target_modules_bd_a=["q_proj"], target_modules_bd_b=["v_proj"],
                                                   nblocks=2)}
    try:  # CAUSAL_LM: PEFT computes aLoRA's offsets only in its causal-LM wrapper (without them aLoRA acts on nothing)
        return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False,
                          task_type="CAUSAL_LM", **extra)
    except TypeError:
        pytest.skip(f"this PEFT has no {kind}")


def build(kind: str):
    from peft import get_peft_model

    torch.manual_seed(0)
    return get_peft_model(make_model(), variant_config(kind))


def gradients(kind: str, selective: bool | None, lean: bool = False):
    model = build(kind)
    model.train()
    if selective is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        if selective:
            layout = Layout.from_pattern(ckpt.layout_of(model).pattern, "lean" if lean else "selective")
            ckpt.apply(model, ckpt.Spec(layout=layout, use_reentrant=False))
    ids = torch.randint(6, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[:, 4] = 5  # aLoRA's invocation token: its adapter acts from there on
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def worst(grads, reference):
    adapters = [r for n, r in reference.items() if "lora_" in n]
    assert any(r.abs().sum() > 0 for r in adapters), "the adapters get no gradient: nothing is compared"
    return max(((grads[n] - r).norm() / r.norm().clamp_min(1e-12)).item() for n, r in reference.items())


@pytest.mark.parametrize("kind", ["lora", "dora", "alora", "bdlora"])
def test_selective_policy_against_no_checkpointing(kind):
    reference = gradients(kind, None)
    assert worst(gradients(kind, False), reference) < 1e-5  # full checkpointing is exact for every variant
    off = worst(gradients(kind, True), reference)
    if kind in ("bdlora", "alora"):
        assert off > 0.1  # silently wrong
    else:
        assert off < 1e-5
        assert worst(gradients(kind, True, lean=True), reference) < 1e-5  # the lean policy too (LoRA's B recomputed)
    assert (probe.selective_unsafe_adapters(build(kind)) != []) is (kind in ("bdlora", "alora"))


@pytest.mark.parametrize("kind", ["lora", "bdlora", "alora"])
def test_the_planner_leaves_selective_out_where_it_is_not_exact(kind, tmp_path):
    from trainers import make_trainer

    callback = SafeGCCallback(memory_budget="64MiB")
    trainer = make_trainer("trainer", build(kind), str(tmp_path), gc_kwargs={"use_reentrant": False},
                           callbacks=[callback], max_steps=1)
    trainer.train()
    said = [d for d in callback.decisions if "selective candidate is left out" in d.reason]
    assert bool(said) is (kind != "lora")
    if said:
        assert {"bdlora": "BdLoraLinearVariant", "alora": "ALoraLinearVariant"}[kind] in said[0].reason
    assert not any(is_selective(f) for _, f in ckpt.functions(trainer.model))
