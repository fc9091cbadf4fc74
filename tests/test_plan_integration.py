"""The memory plan in a real run: chosen at the first training forward, applied to the live model, kept
across TRL's per-step re-enables, gradient-exact, refused or taken at its lowest when nothing fits."""

from __future__ import annotations

import json

import pytest
import torch
from test_rules_v2 import PatternSeen
from trainers import common_args, make_trainer
from transformers import Trainer, TrainerCallback, TrainingArguments

import trl_gc_plugin
from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.model import ckpt
from trl_gc_plugin.planning import memory, planner, throughput
from trl_gc_plugin.testing import make_model

LAYERS, BATCH, SEQ = 4, 2, 128


def model():
    """Blocks that dominate the peak (at 16 tokens the loss head does, and every plan needs the same memory)."""
    return make_model(num_hidden_layers=LAYERS, hidden_size=128, intermediate_size=1024, max_position_embeddings=SEQ)


def data(n=8):
    ids = torch.randint(3, 250, (n, SEQ), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def midway_budget(batch=BATCH):
    """A budget between what checkpointing every block and none need (the benchmark's "midway")."""
    est = memory.estimate(model(), batch, SEQ)
    table = {c.name: c for c in planner.plan(est, 1 << 40, allow_selective=True, allow_offload=False).candidates}
    return (table["none"].peak_bytes + table["full"].peak_bytes) // 2, table


def plan_of(callback):
    (decision,) = [d for d in callback.decisions if d.rule_id == "memory-plan"]
    return decision


def test_a_plan_between_none_and_full_is_chosen_applied_and_gradient_exact(tmp_path):
    budget, _ = midway_budget()
    callback = SafeGCCallback(memory_budget=budget)
    planned = model()
    seen = PatternSeen(planned)
    args = TrainingArguments(**common_args(str(tmp_path / "plan"), max_steps=1, optim="sgd", gradient_checkpointing=True))
    Trainer(model=planned, args=args, train_dataset=data(), callbacks=[callback]).train()
    decision = plan_of(callback)
    # the pick, from the plan's own table (a per-block pick is made for this budget)
    chosen = next(c for c in decision.after["candidates"] if c["name"] == decision.after["plan"])
    assert decision.action == "default" and chosen["name"] not in ("none", "full") and chosen["peak_bytes"] <= budget
    # offloading is not offered on the CPU, and the table says why (the model's activations are in host memory)
    (offload,) = [c for c in decision.after["candidates"] if c["name"] == "offload"]
    assert not offload["allowed"] and "the model is on the CPU" in offload["why_not"]
    pattern = tuple(bool(x) for x in chosen["pattern"])
    assert seen.seen and all(p == pattern for p in seen.seen)  # planned at the first forward, applied there
    full = model()
    args = TrainingArguments(**common_args(str(tmp_path / "full"), max_steps=1, optim="sgd", gradient_checkpointing=True,
                                           gradient_checkpointing_kwargs={"use_reentrant": False}))
    Trainer(model=full, args=args, train_dataset=data()).train()
    for (name, a), (_, b) in zip(planned.named_parameters(), full.named_parameters(), strict=True):
        assert torch.equal(a, b), name  # the same update as checkpointing every block


def test_the_plan_survives_grpos_per_step_re_enables(tmp_path):
    callback = SafeGCCallback(memory_budget=midway_budget()[0])
    planned = model()
    seen = PatternSeen(planned)
    make_trainer("grpo", planned, str(tmp_path), callbacks=[callback], max_steps=3).train()
    decision = plan_of(callback)
    assert decision.action == "default"
    assert len({p for p in seen.seen}) == 1 and seen.seen[0] != (True,) * LAYERS  # GRPO re-enabled every step
    assert not [d for d in callback.decisions if d.rule_id == "checkpointing-drift"]


def _train(callback, out, steps=1):
    planned = model()
    seen = PatternSeen(planned)
    args = TrainingArguments(**common_args(str(out), max_steps=steps, gradient_checkpointing=True))
    Trainer(model=planned, args=args, train_dataset=data(), callbacks=[callback]).train()
    return seen.seen


def test_a_budget_nothing_fits(tmp_path):
    with pytest.raises(GCConfigError, match="memory-plan"):
        _train(SafeGCCallback(memory_budget="1KiB"), tmp_path / "strict")
    callback = SafeGCCallback(mode="fix", memory_budget="1KiB")
    seen = _train(callback, tmp_path / "fix")
    decision = plan_of(callback)
    assert decision.action == "warn" and decision.level == "warning" and decision.after["plan"] == "full"
    assert seen and all(p == (True,) * LAYERS for p in seen)


def test_an_estimate_that_fails_leaves_no_plan_and_trains_as_asked(tmp_path, monkeypatch):
    """A plugin failure in the planner never stops training: the run says why there is no plan and trains with the
    checkpointing asked for (every block)."""

    def fails(*args, **kwargs):
        raise RuntimeError("no fake-tensor kernel")

    callback = SafeGCCallback(memory_budget=midway_budget()[0])
    monkeypatch.setattr(memory, "estimate", fails)
    seen = _train(callback, tmp_path)
    assert plan_of(callback).reason.startswith("No memory plan: the estimate failed (RuntimeError: no fake-tensor")
    assert seen and all(p == (True,) * LAYERS for p in seen)


def test_the_budget_comes_from_the_argument_install_or_the_environment(monkeypatch):
    assert SafeGCCallback(memory_budget="2GiB").memory_budget == 2 << 30
    with pytest.raises(ValueError, match="GiB"):
        SafeGCCallback(memory_budget="lots")
    monkeypatch.setenv("TRL_GC_PLUGIN_BUDGET", "512MiB")
    assert SafeGCCallback().memory_budget == 512 << 20
    with trl_gc_plugin.installed(memory_budget="1GiB"):
        assert SafeGCCallback().memory_budget == 1 << 30
    monkeypatch.setenv("TRL_GC_PLUGIN_BUDGET", "lots")
    with pytest.raises(GCConfigError, match="TRL_GC_PLUGIN_BUDGET: got 'lots'; memory_budget accepts"):
        SafeGCCallback()  # strict: a bad value is refused, naming the variable
    assert SafeGCCallback(mode="warn").memory_budget is None  # warn/fix: said, and the default (no plan) used
    assert SafeGCCallback(memory_budget="auto").memory_budget == "auto"


def test_no_budget_no_plan(tmp_path):
    callback = SafeGCCallback()
    make_trainer("trainer", model(), str(tmp_path), callbacks=[callback], max_steps=1).train()
    assert not [d for d in callback.decisions if d.rule_id == "memory-plan"]


@pytest.mark.parametrize("kind", ["trainer", "dpo"])
def test_the_run_records_batch_advice_and_changes_no_batch(tmp_path, kind):
    """With a plan, the run ranks every micro-batch of the effective batch per device (2 x 2 here) under the same
    budget and records it (rule `batch-advice`, info); the ranking is what `throughput.rank` gives from estimates
    made at each micro-batch; the batch is never changed. DPO's forward runs chosen and rejected rows together:
    its micro-batches are counted in examples, as `per_device_train_batch_size` is."""
    budget, _ = midway_budget(2 * BATCH if kind == "dpo" else BATCH)
    callback = SafeGCCallback(memory_budget=budget)
    if kind == "trainer":  # rows of SEQ tokens: the plan at micro-batch 2 is between none and full
        args = TrainingArguments(**common_args(str(tmp_path), max_steps=1, gradient_checkpointing=True,
                                               gradient_accumulation_steps=2))
        trainer = Trainer(model=model(), args=args, train_dataset=data(), callbacks=[callback])
    else:
        trainer = make_trainer(kind, model(), str(tmp_path), callbacks=[callback], max_steps=1, max_length=SEQ,
                               gradient_accumulation_steps=2)
    trainer.train()
    (advice,) = [d for d in callback.decisions if d.rule_id == "batch-advice"]
    assert advice.action == "none" and advice.level == "info" and advice.before["micro_batch"] == 2
    ranking = advice.after["ranking"]
    assert sorted(r["micro_batch"] for r in ranking) == [1, 2, 4]
    assert all(r["micro_batch"] * r["accumulation"] == 4 for r in ranking)
    assert ranking[0]["relative_speed"] == 1.0 and advice.after["micro_batch"] == ranking[0]["micro_batch"]
    (plan,) = [d for d in callback.decisions if d.rule_id == "memory-plan"]
    planned = plan.after["estimate"]  # rows x tokens the plan was made for: 2 examples (DPO: 4 rows)
    rows, tokens = planned["batch_size"] // 2, planned["seq_len"]
    assert rows == (2 if kind == "dpo" else 1)
    expected = throughput.rank(lambda mb: memory.estimate(model(), mb * rows, tokens), 4, budget,
                               allow_selective=True, allow_offload=False)
    assert [(r["micro_batch"], r["plan"]) for r in ranking] == [
        (o.micro_batch, o.plan.name if o.plan else None) for o in expected]
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 2)
    saved = json.loads((tmp_path / "gc_decisions.json").read_text())
    assert any(d["rule_id"] == "batch-advice" for d in saved)


class LeanSeen(TrainerCallback):
    """Per block, whether it ran the lean selective policy, at the end of every step."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seen.append(ckpt.layout_of(model).lean)


def wide_model():
    """Blocks whose matmuls outweigh the selective policy's per-op cost on CPU (on `model()` it makes selective and
    lean blocks dearer than full ones, and the plan never picks them)."""
    return make_model(num_hidden_layers=LAYERS, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=256)


def wide_data(n=4):
    ids = torch.randint(3, 250, (n, 256), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def test_a_plan_with_lean_blocks_runs_them_and_updates_as_full_checkpointing(tmp_path):
    """At a budget where the plan makes some blocks lean (found from the estimate the run makes too), the run applies
    it at the first forward, runs those blocks lean on every step, and trains as full checkpointing does (the same
    weights after two SGD steps)."""
    est = memory.estimate(wide_model(), BATCH, 256)
    table = {c.name: c for c in planner.candidates(est, allow_selective=True, allow_offload=False)}
    budgets = (round(table["full"].peak_bytes + k / 40 * (table["none"].peak_bytes - table["full"].peak_bytes))
               for k in range(1, 40))
    budget = next(b for b in budgets if any(planner.plan(est, b, allow_selective=True, allow_offload=False)
                                            .chosen.layout.lean))
    callback, lean = SafeGCCallback(memory_budget=budget), LeanSeen()
    planned = wide_model()
    args = TrainingArguments(**common_args(str(tmp_path / "plan"), max_steps=2, optim="sgd", gradient_checkpointing=True))
    Trainer(model=planned, args=args, train_dataset=wide_data(), callbacks=[callback, lean]).train()
    decision = plan_of(callback)
    chosen = next(c for c in decision.after["candidates"] if c["name"] == decision.after["plan"])
    assert decision.action == "default" and chosen["peak_bytes"] <= budget
    expected = tuple(bool(x) for x in chosen["lean_blocks"]) or (chosen["name"] == "selective-lean",) * LAYERS
    assert any(expected), chosen
    assert lean.seen == [expected, expected]
    full = wide_model()
    args = TrainingArguments(**common_args(str(tmp_path / "full"), max_steps=2, optim="sgd", gradient_checkpointing=True,
                                           gradient_checkpointing_kwargs={"use_reentrant": False}))
    Trainer(model=full, args=args, train_dataset=wide_data()).train()
    for (name, a), (_, b) in zip(planned.named_parameters(), full.named_parameters(), strict=True):
        assert torch.equal(a, b), name
