"""Throughput planning (issue 22): micro-batch x accumulation x plan at an equal effective batch, ranked by the cost
model; printed by `trl-gc-plan --effective-batch`, never applied."""

from __future__ import annotations

import json

import pytest
import torch
import zoo

from trl_gc_plugin.cli import plan as plan_cli
from trl_gc_plugin.core.layout import Layout
from trl_gc_plugin.planning import memory, planner, throughput
from trl_gc_plugin.testing import make_config

SEQ = 64


def estimates():
    config = make_config(num_hidden_layers=4)
    cache: dict[int, memory.ActivationEstimate] = {}

    def at(mb: int) -> memory.ActivationEstimate:
        if mb not in cache:
            cache[mb] = memory.estimate(config, mb, SEQ, dtype=torch.float32)
        return cache[mb]

    return at


def test_micro_batches_divide_the_effective_batch():
    assert throughput.micro_batches(8) == [1, 2, 4, 8]
    assert throughput.micro_batches(12, largest=4) == [1, 2, 3, 4]
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError):
            throughput.micro_batches(bad)


def test_each_option_is_the_planners_pick_at_its_micro_batch_and_the_fastest_comes_first():
    at = estimates()
    budget = planner.predict_peak(at(2), Layout.uniform("none", 4))[0]  # micro-batch 2 fits without checkpointing, 8 does not
    options = throughput.rank(at, 8, budget, allow_selective=True, allow_offload=False)
    assert sorted(o.micro_batch for o in options) == [1, 2, 4, 8]
    assert all(o.micro_batch * o.accumulation == 8 for o in options)
    for o in options:
        expected = planner.plan(at(o.micro_batch), budget, allow_selective=True, allow_offload=False).chosen
        assert (o.plan.name if o.plan else None) == (expected.name if expected else None)
        assert o.plan is None or o.plan.peak_bytes <= budget
    assert options[0].relative_speed == 1.0 and options[0].fits
    speeds = [o.relative_speed for o in options]
    assert speeds == sorted(speeds, reverse=True)
    by_mb = {o.micro_batch: o for o in options}
    assert by_mb[2].plan.name == "none"
    assert by_mb[8].plan is None or by_mb[8].plan.name != "none"
    # the cost: accumulation x (per-micro-step constant + forward x (3 + recompute))
    o = by_mb[4]
    forward = planner.forward_cost(at(4), planner.BALANCE["cpu"])
    assert o.cost == pytest.approx(2 * (throughput.MICROSTEP_OVERHEAD["cpu"] + forward * (3 + o.plan.recompute)))


def test_nothing_fits_anywhere():
    options = throughput.rank(estimates(), 4, 1, allow_selective=True, allow_offload=False)
    assert all(not o.fits and o.relative_speed == 0.0 for o in options)


def test_the_command_prints_and_records_the_advice(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(make_config(num_hidden_layers=4).to_json_string())
    at = estimates()
    budget = planner.predict_peak(at(2), Layout.uniform("none", 4))[0]
    code = plan_cli.main([str(config), "--batch-size", "8", "--seq-len", str(SEQ), "--budget", str(budget),
                          "--dtype", "fp32", "--effective-batch", "8"])
    out = capsys.readouterr().out
    assert code == 0 and "ranked by predicted tokens/s" in out and "per_device_train_batch_size=" in out
    code = plan_cli.main([str(config), "--batch-size", "8", "--seq-len", str(SEQ), "--budget", str(budget),
                          "--dtype", "fp32", "--effective-batch", "8", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert [o["micro_batch"] * o["accumulation"] for o in data["throughput"]] == [8] * 4
    assert data["throughput"][0]["relative_speed"] == 1.0
    assert plan_cli.main([str(config), "--batch-size", "2", "--seq-len", str(SEQ), "--budget", "1GiB",
                          "--effective-batch", "0"]) == 2


DENSE_DECODERS = [a for a in zoo.ZOO if a.kind == "decoder"]


@pytest.mark.parametrize("arch", DENSE_DECODERS, ids=[a.name for a in DENSE_DECODERS])
def test_an_estimate_taken_to_more_rows_predicts_what_a_new_estimate_does(arch):
    """The run ranks micro-batches from its one estimate scaled to each micro-batch's rows (no new fake forward):
    every candidate's predicted peak and saved bytes are those of an estimate made at that batch or up to 2% more
    (the tensors without a batch dimension, rotary tables and a causal mask, are scaled too: on the safe side), the
    blocks' FLOPs exactly (the loss's FLOPs on transformers 4.x are not quite linear in the rows)."""
    model = arch.build()
    try:
        two, four = memory.estimate(model, 2, 32), memory.estimate(model, 4, 32)
    except Exception as exc:  # OPT on transformers 4.x builds its mask from a data-dependent value: no plan, no advice
        pytest.skip(f"the estimate cannot run this model here ({type(exc).__name__})")
    scaled = throughput.at_rows(two, 4)
    assert throughput.at_rows(two, 2) is two
    assert (scaled.batch_size, scaled.block_flops) == (4, four.block_flops)
    assert scaled.outside_flops == pytest.approx(four.outside_flops, rel=0.01)  # the loss: a few FLOPs per batch
    n = four.num_blocks
    layouts = [Layout.uniform(kind, n) for kind in ("none", "full", "selective")]
    for layout in [*layouts, Layout.from_pattern(planner.spread(1, n))]:
        # per-sequence tensors (rotary tables, a causal mask without a batch dimension) scale too: over, never under
        fresh, taken = planner.predict_peak(four, layout)[0], planner.predict_peak(scaled, layout)[0]
        assert fresh <= taken <= 1.02 * fresh, (layout, taken, fresh)
        fresh, taken = four.saved_bytes(layout), scaled.saved_bytes(layout)
        assert fresh <= taken <= 1.02 * fresh, (layout, taken, fresh)
