"""A memory budget under torch.compile (issue 47): the plugin plans before the first forward, from the arguments'
batch shape, and either compiles its plan's layout or hands the budget to AOTAutograd's min-cut partitioner
(`torch._functorch.config.activation_memory_budget`, set back at the run's end); the choice and its reason are in the
decisions. A tiny model (2 layers, hidden 32): compiling on the CPU is slow."""

from __future__ import annotations

import pytest
import torch
from trainers import make_trainer
from transformers import TrainerCallback

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model import ckpt
from trl_gc_plugin.planning import memory, planner
from trl_gc_plugin.testing import make_model

dynamo = pytest.importorskip("torch._dynamo")
functorch_config = pytest.importorskip("torch._functorch.config")

BATCH, SEQ = 2, 32  # make_trainer's per-device batch and SFT max_length


def tiny():
    return make_model(num_hidden_layers=2, hidden_size=32, intermediate_size=64, max_position_embeddings=SEQ)


class Seen(TrainerCallback):
    """What the training steps ran with: torch's partitioner budget and the blocks' checkpointing flags."""

    def __init__(self):
        self.budgets, self.patterns = [], []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.budgets.append(functorch_config.activation_memory_budget)
        self.patterns.append(tuple(getattr(b, "gradient_checkpointing", False) for b in ckpt.blocks(model)))


def test_under_torch_compile_the_budget_goes_to_the_partitioner_and_comes_back(tmp_path):
    est = memory.estimate(tiny(), BATCH, SEQ)
    table = {c.name: c for c in planner.candidates(est, allow_selective=True, allow_offload=False)}
    budget = (table["none"].peak_bytes + table["full"].peak_bytes) // 2  # midway: neither end fits exactly
    dynamo.reset()
    before = functorch_config.activation_memory_budget
    callback, seen = SafeGCCallback(memory_budget=budget), Seen()
    trainer = make_trainer("sft", tiny(), str(tmp_path), gc_kwargs={"use_reentrant": False},
                           callbacks=[callback, seen], max_steps=2, torch_compile=True,
                           torch_compile_backend="aot_eager")  # min-cut partitioner
    trainer.train()
    decisions = [d for d in callback.decisions if d.rule_id == "memory-plan"]
    (compiled,) = [d for d in decisions if d.setting == "torch_compile_memory_budget"]
    (plan,) = [d for d in decisions if d.setting == "checkpointing_plan"]
    assert plan.after["plan"] not in ("none", "full")  # a plan between the ends was made
    assert compiled.after["way"] == "partitioner", compiled.reason
    fraction = compiled.after["activation_memory_budget"]
    assert 0.0 < fraction < 1.0
    assert "activation_memory_budget set to" in compiled.reason and "on the CPU benchmark" in compiled.reason
    # the steps ran with the partitioner's budget and no checkpointing; the run's end set the budget back
    assert seen.budgets == [fraction, fraction]
    assert seen.patterns and all(not any(p) for p in seen.patterns), seen.patterns
    assert functorch_config.activation_memory_budget == before
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_under_torch_compile_without_a_sequence_length_no_plan_is_made(tmp_path):
    dynamo.reset()
    callback = SafeGCCallback(memory_budget="1GiB")
    make_trainer("trainer", tiny(), str(tmp_path), gc_kwargs={"use_reentrant": False}, callbacks=[callback],
                 max_steps=1, torch_compile=True, torch_compile_backend="aot_eager").train()
    (decision,) = [d for d in callback.decisions if d.rule_id == "memory-plan"]
    assert decision.reason.startswith("No memory plan: torch_compile=True, and the arguments give no sequence length")
    assert functorch_config.activation_memory_budget == 1.0


def test_the_choice_follows_the_measured_table():
    est = memory.estimate(tiny(), BATCH, SEQ)
    table = {c.name: c for c in planner.candidates(est, allow_selective=True, allow_offload=False)}
    none, full = table["none"].peak_bytes, table["full"].peak_bytes
    everything = planner.compiled_choice(planner.plan(est, none + 1, allow_selective=True, allow_offload=False))
    assert everything.way == "plan" and "no checkpointing fits" in everything.why
    nothing = planner.compiled_choice(planner.plan(est, 1024, allow_selective=True, allow_offload=False))
    assert nothing.way == "plan" and "no plan fits" in nothing.why
    for f, way in planner.COMPILED_FASTER:
        plan = planner.plan(est, round(full + f * (none - full)), allow_selective=True, allow_offload=False)
        choice = planner.compiled_choice(plan)
        assert f"at {f:.0%} of the way" in choice.why, (f, choice)
        assert choice.way == way, (f, choice)
        assert (choice.fraction is not None) == (choice.way == "partitioner")
