"""Per-block mixed plans (issue 22): each block none, selective or full, chosen by a knapsack to minimise the
predicted recompute under the budget; exact, under the budget measured, optimal against brute force on non-uniform
blocks, and applied block by block on the live model."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from trl_gc_plugin.core.layout import Layout
from trl_gc_plugin.model import ckpt
from trl_gc_plugin.planning import memory, planner

LAYERS, BATCH, SEQ = 6, 2, 64


def build():
    from trl_gc_plugin.testing import make_model

    model = make_model(num_hidden_layers=LAYERS)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def inputs(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def grads(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def a_budget_where_mixed_wins(est, lean: bool = False) -> tuple[int, planner.Candidate]:
    """A budget between full and no checkpointing where a per-block plan with selective blocks (lean ones with
    `lean`) beside others beats every uniform candidate (no per-op cost for the selective policy: on this tiny model
    the CPU's constant would rule selective out everywhere)."""
    table = planner.candidates(est, allow_selective=True, allow_offload=False, op_overhead=0.0)
    by = {c.name: c for c in table}
    for step in range(1, 80):
        budget = round(by["full"].peak_bytes + step / 80 * (by["none"].peak_bytes - by["full"].peak_bytes))
        result = planner.plan(est, budget, allow_selective=True, allow_offload=False, op_overhead=0.0)
        chosen = result.chosen
        wanted = any(chosen.layout.lean) if lean and chosen is not None else True
        if chosen is not None and chosen.name == "mixed" and any(chosen.layout.selective) and wanted:
            uniform = next(c for c in table if c.allowed and c.peak_bytes <= budget)
            assert chosen.recompute < uniform.recompute
            return budget, chosen
    raise AssertionError("no budget where the per-block plan wins: the test model no longer shows it")


@pytest.mark.parametrize("lean", [False, True])
def test_a_mixed_plan_is_exact_and_fits_the_budget_measured(lean):
    model = build()
    batch = inputs(model.config.vocab_size)
    reference = grads(model, batch)  # full checkpointing
    est = memory.estimate(model, BATCH, SEQ)
    budget, mixed = a_budget_where_mixed_wins(est, lean)
    assert len(set(mixed.layout.selective)) == 2, mixed.summary()  # selective blocks beside others
    if lean:  # lean blocks beside plain selective or other blocks
        assert any(mixed.layout.lean) and not all(mixed.layout.lean), mixed.summary()
        assert "lean selective" in mixed.summary()
    planner.apply_plan(model, mixed, use_reentrant=False)
    assert ckpt.layout_of(model).pattern == mixed.layout.pattern
    assert ckpt.layout_of(model).selective == mixed.layout.selective
    assert ckpt.layout_of(model).lean == mixed.layout.lean
    assert ckpt.layout_of(model) == mixed.layout
    got = grads(model, batch)
    assert all(torch.equal(got[k], reference[k]) for k in reference)
    model.zero_grad(set_to_none=True)
    with memory.live_bytes() as live:
        model(**batch).loss.backward()
    assert live.peak <= budget, (live.peak, budget)
    assert memory.measure(model, batch).total == mixed.saved_bytes
    # a per-step re-enable (TRL) sets every block back: drift sees it, the plan goes back on
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert ckpt.layout_of(model) != mixed.layout
    planner.apply_plan(model, mixed, use_reentrant=False)
    assert ckpt.layout_of(model) == mixed.layout


def test_a_mixed_plan_is_never_selective_with_reentrant():
    model = build()
    est = memory.estimate(model, BATCH, SEQ)
    _, mixed = a_budget_where_mixed_wins(est)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        planner.apply_plan(model, mixed, use_reentrant=True)
    result = planner.plan(est, mixed.peak_bytes, allow_selective=False, allow_offload=False, op_overhead=0.0)
    assert not any(c.layout.selective[i] for c in result.candidates if c.allowed for i in range(LAYERS))


def uneven(n: int = 5) -> memory.ActivationEstimate:
    """A hand-made estimate of blocks of different sizes and costs (a vision tower beside decoder blocks, MoE blocks
    beside dense ones), with the loss head the peak phase."""
    saved = (900, 400, 1500, 700, 1200)[:n]
    return memory.ActivationEstimate(
        blocks=tuple(f"b{i}" for i in range(n)),
        saved=saved,
        inputs=(50, 40, 60, 50, 70)[:n],
        input_saved=(50, 40, 60, 50, 70)[:n],
        selective=(300, 100, 900, 150, 400)[:n],
        lean=(120, 60, 400, 100, 150)[:n],
        lean_matmul_flops=(5e6, 0.5e6, 20e6, 1.5e6, 6e6)[:n],
        shared=0,
        kwargs_bytes=0,
        outside=100,
        loss_buffer_bytes=2000,
        grad_bytes=(1,) * n,
        head_grad_bytes=1,
        embedding_grad_bytes=1,
        transient_bytes=1,
        block_flops=(9e6, 2e6, 30e6, 5e6, 12e6)[:n],
        matmul_flops=(8e6, 1e6, 28e6, 2e6, 11e6)[:n],
        other_bytes=(1000, 1000, 3000, 4000, 1000)[:n],
        ops=(10,) * n,
        outside_flops=1e6,
        batch_size=1,
        seq_len=1,
        dtype="float32",
        attn_implementation="sdpa",
        method="hand-made",
        measured_blocks=n,
    )


@pytest.mark.parametrize("allow_selective", [True, False])
def test_the_knapsack_finds_the_brute_force_optimum_on_uneven_blocks(allow_selective):
    est = uneven()
    kinds = ("none", "full", "selective", "lean") if allow_selective else ("none", "full")
    brute = []
    for choice in itertools.product(kinds, repeat=est.num_blocks):
        layout = Layout(choice)
        peak = planner.predict_peak(est, layout)[0]
        cost = planner.recompute_cost(est, layout, 170.0, 1e6)
        brute.append((cost, peak, sum(est.kept(layout))))
    full_peak = planner.predict_peak(est, Layout.uniform("full", est.num_blocks))[0]
    none_peak = planner.predict_peak(est, Layout.uniform("none", est.num_blocks))[0]
    found_mixed = found_lean = 0
    for step in range(0, 21):
        budget = round(full_peak + step / 20 * (none_peak - full_peak))
        mixed = planner.mixed_candidate(est, budget, allow_selective=allow_selective, balance=170.0, op_overhead=1e6)
        room = budget - (est.outside + est.kwargs_bytes + 2 * est.loss_buffer_bytes)
        margin = est.num_blocks * room / planner.KNAPSACK_UNITS  # the knapsack rounds each block up by < 1 unit
        feasible = [cost for cost, peak, kept in brute if peak <= budget and kept <= room - margin]
        if not feasible:  # only plans within the rounding of the room fit: the uniform candidates cover them
            continue
        assert mixed is not None and mixed.peak_bytes <= budget
        assert mixed.recompute <= min(feasible) + 1e-12, (step, mixed.recompute, min(feasible))
        assert allow_selective or not any(mixed.layout.selective)
        found_mixed += len(set(mixed.layout.selective)) > 1 or 0 < sum(mixed.layout.pattern) < est.num_blocks
        found_lean += any(mixed.layout.lean)
    assert found_mixed >= 5
    assert (found_lean > 0) is allow_selective


def test_the_plan_is_never_worse_than_a_uniform_candidate():
    """On uniform blocks the knapsack can only place the same blocks better (a lower peak at the same cost): the pick
    never recomputes more than the uniform candidate that fits the same budget."""
    from trl_gc_plugin.testing import make_config

    est = memory.estimate(make_config(num_hidden_layers=8), BATCH, SEQ, dtype=torch.float32)
    for allow_selective in (False, True):
        table = planner.candidates(est, allow_selective=allow_selective, allow_offload=False)
        for c in (c for c in table if c.allowed):
            result = planner.plan(est, c.peak_bytes, allow_selective=allow_selective, allow_offload=False)
            assert result.chosen.recompute <= c.recompute and result.chosen.peak_bytes <= c.peak_bytes


def test_the_candidate_serialises_its_blocks():
    est = uneven()
    mixed = planner.mixed_candidate(est, 5500, allow_selective=True, balance=170.0, op_overhead=1e6)
    data = mixed.to_dict()
    assert data["name"] == "mixed" and len(data["selective_blocks"]) in (0, est.num_blocks)
    assert len(data["lean_blocks"]) in (0, est.num_blocks) and set(data["lean_blocks"]) <= {0, 1}
    assert dataclasses.replace(mixed).summary().startswith("mixed (")
