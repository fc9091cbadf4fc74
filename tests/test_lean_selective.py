"""Lean selective checkpointing (issue 22): the selective policy less the outputs of widening matmuls (an MLP's up and
gate projections, fused QKV, LoRA's `B`), a per-block option between selective and full checkpointing. On every
architecture of the zoo: exact against full checkpointing, what its cache holds equals what the estimate's fake run
says it would keep, and never more than selective keeps."""

from __future__ import annotations

import pytest
import torch
import zoo

from trl_gc_plugin.core.layout import Layout
from trl_gc_plugin.model import ckpt
from trl_gc_plugin.planning import memory


def gradients(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in every run
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", zoo.ZOO, ids=lambda a: a.name)
def test_lean_is_exact_and_keeps_what_the_estimate_says(arch):
    torch.manual_seed(0)
    model = arch.build()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = ckpt.blocks(model)
    if not blocks:
        pytest.skip(f"{arch.name}: no checkpointed blocks")
    batch = arch.batch(0)
    reference = gradients(model, batch)  # full checkpointing
    kept = {}
    for name in ("selective", "lean"):
        ckpt.apply(model, ckpt.Spec(layout=Layout.uniform(name, len(blocks))))
        assert ckpt.layout_of(model).lean == (name == "lean",) * len(blocks)
        got = gradients(model, batch)
        assert all(torch.equal(got[k], reference[k]) for k in reference), (arch.name, name)
        kept[name] = memory.measure(model, batch).selective
    ckpt.apply(model, ckpt.Spec(layout=Layout.uniform("none", len(blocks))))
    would = memory.measure(model, batch, would_keep=True)
    assert would.selective == kept["selective"], arch.name
    assert would.lean == kept["lean"], arch.name
    assert all(lean <= sel for lean, sel in zip(kept["lean"], kept["selective"], strict=True))
    # lean keeps less exactly where selective kept a widening matmul (where none runs, lean is selective and the
    # planner offers no lean option)
    widening_kept = would.lean_matmul_flops != would.matmul_flops
    assert (sum(kept["lean"]) < sum(kept["selective"])) is widening_kept, arch.name


@pytest.mark.parametrize("arch", [a for a in zoo.ZOO if a.kind == "moe"], ids=lambda a: a.name)
def test_grouped_expert_matmuls_are_kept_and_counted(arch):
    """transformers 5.x runs MoE experts as `aten._grouped_mm` (4.x as one `mm` per expert): selective keeps their
    outputs like any matmul's, and the cost model counts their FLOPs (2 x rows x K x N), measured here independently
    of the planner's own counting. Before, neither was: a selective MoE block recomputed its experts while the cost
    model priced it as cheap."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = arch.build()
    model.train()
    blocks = ckpt.blocks(model)
    grouped = []

    class Grouped(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._grouped_mm.default:
                a, b = args[0], args[1]
                grouped.append((2 * a.shape[0] * a.shape[-1] * b.shape[-1], out.untyped_storage().nbytes()))
            return out

    mode = Grouped()
    handles = [blocks[0].register_forward_pre_hook(lambda *_: mode.__enter__() and None),
               blocks[0].register_forward_hook(lambda *_: mode.__exit__(None, None, None) and None)]
    model(**arch.batch(0))
    for h in handles:
        h.remove()
    if not grouped:
        pytest.skip(f"this transformers runs {arch.name}'s experts without _grouped_mm")
    would = memory.measure(model, arch.batch(0), would_keep=True)
    flops, nbytes = sum(f for f, _ in grouped), sum(n for _, n in grouped)
    assert would.matmul_flops[0] >= flops and would.block_flops[0] >= flops, (would.matmul_flops[0], flops)
    assert would.selective[0] >= nbytes
    assert would.lean[0] <= would.selective[0] - grouped[0][1]  # the first (gate and up, fused) widens: recomputed


@pytest.mark.parametrize("arch", [a for a in zoo.ZOO if a.kind == "moe"], ids=lambda a: a.name)
def test_both_policies_keep_the_routers_logits(arch):
    """MoE routing recomputed differently from the forward (torchtitan #3146) cannot happen under the plugin's
    policies: both keep the router's gate matmul, so the recompute's softmax and top-k read the forward's logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trl_gc_plugin.model import policies

    torch.manual_seed(0)
    model = arch.build()
    model.train()
    experts = next(getattr(model.config, k) for k in ("num_local_experts", "num_experts") if hasattr(model.config, k))
    routers = [m for m in model.modules() if getattr(getattr(m, "weight", None), "shape", (None,))[0] == experts
               and m.weight.dim() == 2]
    assert routers, arch.name
    logits = []
    for router in routers:
        router.register_forward_hook(lambda m, a, out: logits.append(out[0] if isinstance(out, tuple) else out))
    state = policies.policy_state()
    kept: dict[str, set] = {"selective": set(), "lean": set()}

    class Keeps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for name, keeps in (("selective", policies.keeps), ("lean", policies.lean_keeps)):
                if keeps(func, args, state):
                    kept[name].update(t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(out)
                                      if isinstance(t, torch.Tensor))
            return out

    with Keeps():
        model(**arch.batch(0))
    assert len(logits) == len(routers)
    for name in ("selective", "lean"):
        assert all(t.untyped_storage().data_ptr() in kept[name] for t in logits), (arch.name, name)
