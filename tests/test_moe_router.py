"""Rule `router-logits-need-non-reentrant` (issue 26, item 1): an MoE model whose load-balancing loss reads router
logits that a hook records inside the checkpointed blocks (`_can_record_outputs["router_logits"]`) gives the
routers no gradient from that loss under reentrant checkpointing, silently. Reproduced without the plugin per
architecture; where the model returns router logits as layer outputs instead (Qwen2-MoE and OLMoE on transformers
4.57), reentrant is exact and the plugin says nothing."""

from __future__ import annotations

import pytest
import torch
import transformers
from zoo import LLAMA_LIKE, Arch, _causal, lm_batch
from zoo_run import run

from trl_gc_plugin.model import ckpt, probe

MOE = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
}


def arch(name: str) -> Arch:
    config, extra = MOE[name]
    build = _causal(config, output_router_logits=True, router_aux_loss_coef=1.0, **extra, **LLAMA_LIKE)
    return Arch(name, build, lm_batch, ("q_proj", "v_proj"), kind="moe")


def recorded(name: str) -> bool:
    model = arch(name).build()
    return probe.records_router_logits_in_blocks(model, ckpt.blocks(model))


def router_grads(name: str, use_reentrant: bool | None) -> dict[str, torch.Tensor]:
    """One forward/backward of the training loss (LM + load balancing) without the plugin."""
    model = arch(name).build()
    model.train()
    if use_reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.enable_input_require_grads()
    model(**lm_batch(0)).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith(("gate.weight", "router.weight"))
            and p.grad is not None}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


def routers(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("gate.weight", "router.weight"))}


@pytest.mark.parametrize("name", list(MOE))
def test_the_fact_predicts_the_failure_without_the_plugin(name):
    reference = router_grads(name, None)
    assert reference, "no router gradient found"
    assert rel(router_grads(name, False), reference) < 1e-5  # non-reentrant is exact
    lost = rel(router_grads(name, True), reference)
    if recorded(name):
        assert lost > 0.5  # the silent failure
    else:
        assert lost < 1e-5  # router logits returned as outputs: reentrant is exact, nothing to say


@pytest.mark.parametrize("name", list(MOE))
def test_the_plugin_refuses_explicit_reentrant_only_where_it_loses_the_router_gradient(name):
    outcome = run(arch(name), "full", True, plugin="strict")
    if recorded(name):
        assert outcome.refused
        assert [d.action for d in outcome.decisions if d.rule_id == "router-logits-need-non-reentrant"] == ["error"]
        assert outcome.changed_at_error == frozenset()
    else:
        assert outcome.error is None
        assert not [d for d in outcome.decisions if d.rule_id == "router-logits-need-non-reentrant"]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("how", [("unset", "strict"), (True, "fix")], ids=["unset", "explicit-fix"])
def test_with_the_plugin_the_routers_train_as_without_checkpointing(name, how):
    use_reentrant, mode = how
    reference_model = arch(name).build()
    assert run(arch(name), "full", gc=False, model=reference_model).error is None
    model = arch(name).build()
    outcome = run(arch(name), "full", use_reentrant, plugin=mode, model=model)
    assert outcome.error is None
    expected, got = routers(reference_model), routers(model)
    assert all(torch.allclose(got[n], expected[n], atol=1e-5) for n in expected), transformers.__version__
    decisions = [d for d in outcome.decisions if d.rule_id == "router-logits-need-non-reentrant"]
    if not recorded(name):  # router logits returned as layer outputs (older transformers): reentrant is exact too
        assert not decisions
        return
    assert outcome.running is False
    if use_reentrant is True:
        assert [(d.action, d.after) for d in decisions] == [("override", False)]
