"""The memory plan checked against the first real step: for the batch each trainer really runs (Trainer, SFT's
padded rows, DPO's chosen + rejected rows, GRPO's completions, TRL's fused LM head), the predicted saved bytes match
an independent measurement of that forward; an accurate plan is not reported, one a forward wrapper or a hook
invalidates is, in every mode, and fix mode re-plans from the measurement. No hook stays on the model."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
import torch
from trainers import make_trainer

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.core.decisions import Decision
from trl_gc_plugin.model import ckpt
from trl_gc_plugin.planning import memory, plan_check
from trl_gc_plugin.testing import make_model

LAYERS = 4
MODES = {"none": "strict", "full": "warn"}  # the plan applied (no block checkpointed) / not applied: every block
CHECK = "memory_plan_check"


def model():
    return make_model(num_hidden_layers=LAYERS, hidden_size=128, intermediate_size=1024, max_position_embeddings=128)


class FirstForward:
    """The keyword arguments of the model's first training forward, kept (tensors cloned) to measure it again."""

    def __init__(self, module):
        self.kwargs = None
        self.handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if self.kwargs is None and module.training and torch.is_grad_enabled():
            self.kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            self.handle.remove()


def checks(callback):
    return [d for d in callback.decisions if d.rule_id == "memory-plan" and d.setting == CHECK]


def plans(callback):
    return [d for d in callback.decisions if d.rule_id == "memory-plan" and d.setting == "checkpointing_plan"]


def plugin_hooks(module):
    """Forward hooks of the plugin's own on any submodule (the plan's, the check's, the meter's)."""
    found = []
    for m in module.modules():
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            for hook in getattr(m, name).values():
                func = getattr(hook, "func", hook)
                if getattr(func, "__module__", "").startswith("trl_gc_plugin"):
                    found.append((type(m).__name__, name, getattr(func, "__qualname__", func)))
    return found


@pytest.mark.parametrize("running", sorted(MODES))
@pytest.mark.parametrize("kind", ["trainer", "sft", "dpo", "grpo"])
def test_the_prediction_matches_the_first_step(kind, running, tmp_path):
    callback = SafeGCCallback(mode=MODES[running], memory_budget="1TiB")
    trained = model()
    first = FirstForward(trained)
    trainer = make_trainer(kind, trained, str(tmp_path), callbacks=[callback], max_steps=2,
                           per_device_train_batch_size=4)
    trainer.train()
    (decision,) = plans(callback)
    assert decision.after["plan"] == "none"
    assert not plugin_hooks(trainer.model)  # the plan's and the check's hooks are gone after the first step
    assert not checks(callback), checks(callback)  # an accurate plan is not reported
    comparison = callback.plan_check
    rows = first.kwargs["input_ids"].shape[0]
    assert comparison.batch_shape == tuple(first.kwargs["input_ids"].shape)
    if kind == "dpo":
        assert rows == 2 * 4  # chosen and rejected, concatenated
    # measured again, independently of the plugin's check: the same forward on the model as the plan left it
    trainer.model.train()
    again = memory.measure(trainer.model, first.kwargs)
    assert abs(comparison.predicted - again.total) <= 0.10 * again.total, (comparison, again.total)
    assert abs(comparison.measured - again.total) <= 0.01 * again.total, (comparison, again.total)
    assert comparison.pattern == (running == "full",) * LAYERS


class Doubled:
    """A forward wrapper the fake copy cannot follow (it reaches the model through a registry, not its closure):
    it runs every batch twice, concatenated."""

    registry: ClassVar[dict[int, torch.nn.Module]] = {}

    def __init__(self, module):
        self.key = id(module)
        Doubled.registry[self.key] = module
        module.forward = self

    def __call__(self, input_ids=None, labels=None, attention_mask=None, **kwargs):
        module = Doubled.registry[self.key]
        twice = {"input_ids": torch.cat([input_ids, input_ids])}
        if labels is not None:
            twice["labels"] = torch.cat([labels, labels])
        if attention_mask is not None:
            twice["attention_mask"] = torch.cat([attention_mask, attention_mask])
        return type(module).forward(module, **twice, **kwargs)


def _double_rows_hook(module, args, kwargs):
    """A user's forward pre-hook (hooks are not copied into the estimate) that runs every batch twice."""
    kwargs = dict(kwargs)
    for key in ("input_ids", "labels", "attention_mask"):
        if isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = torch.cat([kwargs[key], kwargs[key]])
    return args, kwargs


@pytest.mark.parametrize("mode", ["strict", "warn", "fix"])
@pytest.mark.parametrize("how", ["wrapper", "hook"])
def test_an_invalidated_plan_is_reported(how, mode, tmp_path):
    callback = SafeGCCallback(mode=mode, memory_budget="1TiB")
    trained = model()
    if how == "wrapper":
        Doubled(trained)
    else:
        trained.register_forward_pre_hook(_double_rows_hook, with_kwargs=True)
    make_trainer("trainer", trained, str(tmp_path), callbacks=[callback], max_steps=2).train()
    (check,) = checks(callback)
    assert check.action == "warn" and check.level == "warning"
    after = check.after
    assert after["measured"] > 1.5 * after["predicted"]  # twice the rows
    assert after["batch_shape"] == [2, 16] and after["planned_shape"] == [2, 16]
    assert check.before == after["predicted"]
    assert (after["replanned"] is not None) == (mode == "fix")
    if mode == "fix":  # re-planned from the measurement: a second plan decision
        assert len(plans(callback)) == 2
    loaded = [Decision.from_dict(d) for d in json.loads((tmp_path / "gc_decisions.json").read_text())]
    loaded = [d for d in loaded if d.setting == CHECK]
    assert loaded and loaded[0].after["measured"] == after["measured"]  # both figures and the shape in the file


def test_a_replan_follows_the_measurement(tmp_path):
    """Fix mode, a budget midway between what checkpointing every block and none need at 2 x 128 tokens: the plan
    made for that batch does not fit the doubled one the hook runs; the re-plan checkpoints more blocks."""
    from test_plan_integration import data, midway_budget
    from trainers import common_args
    from transformers import Trainer, TrainingArguments

    budget, _ = midway_budget()
    callback = SafeGCCallback(mode="fix", memory_budget=budget)
    trained = model()
    trained.register_forward_pre_hook(_double_rows_hook, with_kwargs=True)
    args = TrainingArguments(**common_args(str(tmp_path), max_steps=2, gradient_checkpointing=True))
    Trainer(model=trained, args=args, train_dataset=data(), callbacks=[callback]).train()
    first, second = plans(callback)
    (check,) = checks(callback)
    assert check.after["replanned"] == second.after["plan"]
    def blocks(plan):  # checkpointed blocks of the plan's pick (each plan has its own table: a per-block pick too)
        return next(sum(c["pattern"]) for c in plan.after["candidates"] if c["name"] == plan.after["plan"])

    assert blocks(second) > blocks(first)
    assert sum(ckpt.layout_of(trained).pattern) == blocks(second)  # applied to the live model


def test_a_packed_sft_batch_is_planned_as_one_row_of_batch_times_max_length(tmp_path):
    """SFT with BFD packing (padding-free): the batch is one row of every packed sequence; the plan is for one row of
    per_device_train_batch_size x max_length tokens, the check for the row that ran."""
    callback = SafeGCCallback(memory_budget="1TiB")
    trained = model()
    first = FirstForward(trained)
    trainer = make_trainer("sft", trained, str(tmp_path), callbacks=[callback], max_steps=2,
                           per_device_train_batch_size=4, packing=True)
    trainer.train()
    (decision,) = plans(callback)
    assert (decision.after["estimate"]["batch_size"], decision.after["estimate"]["seq_len"]) == (1, 4 * 32)
    rows, tokens = first.kwargs["input_ids"].shape
    assert rows == 1 and tokens > 32  # several sequences in one row
    comparison = callback.plan_check
    assert comparison.batch_shape == (1, tokens) and not checks(callback)
    trainer.model.train()
    again = memory.measure(trainer.model, first.kwargs)
    assert abs(comparison.predicted - again.total) <= 0.10 * again.total, (comparison, again.total)


def test_no_hook_of_the_plan_or_its_check_survives_the_first_step(tmp_path):
    from transformers import TrainerCallback

    class AfterStepOne(TrainerCallback):
        found = None

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                AfterStepOne.found = plugin_hooks(model)

    trained = model()
    make_trainer("dpo", trained, str(tmp_path), callbacks=[SafeGCCallback(memory_budget="1TiB"), AfterStepOne()],
                 max_steps=2).train()
    assert AfterStepOne.found == []


def test_a_wrapper_that_closes_over_the_forward_is_followed_by_the_estimate(tmp_path):
    """A forward wrapper holding the original bound forward in its closure (as TRL's fused LM head does) runs on the
    estimate's fake copy too: a wrapper that doubles the batch is predicted, not reported."""
    callback = SafeGCCallback(memory_budget="1TiB")
    trained = model()
    original = trained.forward

    def doubled(input_ids=None, labels=None, attention_mask=None, **kwargs):
        twice = {k: torch.cat([v, v]) for k, v in
                 {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}.items() if v is not None}
        return original(**twice, **kwargs)

    trained.forward = doubled
    make_trainer("trainer", trained, str(tmp_path), callbacks=[callback], max_steps=2).train()
    comparison = callback.plan_check
    assert comparison.batch_shape == (2, 16) and not checks(callback)
    assert abs(comparison.predicted - comparison.measured) <= 0.10 * comparison.measured, comparison


def test_the_held_check_warns_above_the_tolerance_and_when_it_could_not_read():
    assert plan_check.held_miss(1000, {"max": 1150, "failed": None}) is None
    warning = plan_check.held_miss(1000, {"max": 1151, "failed": None})
    assert warning is not None and "(1000 bytes)" in warning and "(1151 bytes) at once" in warning
    assert "could not be read (KeyError: 'x')" in plan_check.held_miss(1000, {"max": 0, "failed": "KeyError: 'x'"})


def test_a_failing_held_reading_never_stops_the_forward():
    """`sharding.watch_held` samples inside the user's forward: a reading that raises (another release's internals)
    stops the sampling and is said after the forward, never raised into it."""
    from trl_gc_plugin.planning import sharding

    model = make_model().train()
    calls = []

    def broken() -> int:
        calls.append(1)
        raise KeyError("x")

    record, remove = sharding.watch_held(model, broken)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    remove()
    assert len(calls) == 1 and record["failed"] == "KeyError: 'x'" and record["max"] == 0


class UserHooks:
    """A user's own saved-tensor hooks around each training step's loss (what TRL's activation offloading, `save_on_cpu`
    or a memory meter of one's own puts there): the bytes they see per step."""

    def __init__(self):
        self.per_step = []

    def compute_loss(self, original):
        def wrapped(*args, **kwargs):
            seen = [0]

            def pack(tensor):
                seen[0] += tensor.numel() * tensor.element_size()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = original(*args, **kwargs)
            self.per_step.append(seen[0])
            return loss

        return wrapped


def test_the_first_step_meter_never_hides_a_users_saved_tensor_hooks(tmp_path):
    """With a memory budget the plan is checked against what the first training forward saved, measured with
    saved-tensor hooks; hooks are innermost-wins, so a user's own hooks around that forward saw nothing of it (0
    bytes on the first step, the right figure on the next, measured before the fix). The meter now counts and hands
    every tensor on to the hooks it found in scope: theirs see the first step as they see every other."""
    user = UserHooks()
    callback = SafeGCCallback(memory_budget="1GiB")
    trainer = make_trainer("trainer", model(), str(tmp_path), callbacks=[callback], max_steps=2)
    trainer.compute_loss = user.compute_loss(trainer.compute_loss)
    trainer.train()
    assert plans(callback) and callback.plan_check is not None  # the plan was made and checked on the first step
    first, second = user.per_step
    assert first > 0 and first == second, user.per_step
