"""The first-forward observation: what it sees on real models, and that nothing of it stays after the first step."""

from __future__ import annotations

import functools

import pytest
import torch
from custom_models import LegacyModel, StackModel, batches, tiny
from trainers import TF5, common_args
from transformers import Trainer, TrainerCallback, TrainingArguments
from zoo_run import build, run

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.model import hooks as _hooks
from trl_gc_plugin.model.ckpt import functions as checkpoint_functions
from trl_gc_plugin.model.hooks import Hooks
from trl_gc_plugin.model.observe import Observation, _Observer


def hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class Snapshot(TrainerCallback):
    """What the model carries at the start of each step (after the plugin's own on_step_begin)."""

    def __init__(self):
        self.at_step = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        funcs = [f for _, f in checkpoint_functions(model)]
        self.at_step.append((hooks(model), sum(isinstance(f, _Observer) for f in funcs), _hooks.waiting()))


@pytest.mark.parametrize("arch", ["llama", "llava", "t5"])
def test_nothing_of_the_observation_stays_after_the_first_step(arch):
    bare = Snapshot()
    assert run(arch, "full", extra_callbacks=[bare], steps=3).error is None
    snapshot, callback = Snapshot(), SafeGCCallback()
    model = build(__import__("zoo").BY_NAME[arch], "full")
    outcome = run(arch, "full", model=model, extra_callbacks=[callback, snapshot], steps=3)
    assert outcome.error is None, outcome.error
    # step 1 starts with every checkpointing stack watched (a pre- and a post-hook each, process-wide, so the model
    # itself carries exactly what it carries without the plugin at every step); from step 2 on nothing waits, and no
    # observer is left in a checkpoint function
    assert snapshot.at_step[0][2] > 0 == bare.at_step[0][2]
    assert [h for h, _, _ in snapshot.at_step] == [h for h, _, _ in bare.at_step]
    assert all(w == 0 for _, _, w in snapshot.at_step[1:]) and all(n == 0 for _, n, _ in snapshot.at_step)
    assert all(isinstance(f, functools.partial) for _, f in checkpoint_functions(model))
    assert callback._run.first_forward.observation is None and callback.observed


def test_every_stack_is_observed_with_its_own_inputs():
    """LLaVA: the vision tower and the language model are observed separately, each with its own input."""
    callback = SafeGCCallback()
    outcome = run("llava", "lora_hooked", use_reentrant=False, plugin=None, extra_callbacks=[callback])
    assert outcome.error is None
    vision = [c for n, c in callback.observed.items() if "vision" in n]
    text = [c for n, c in callback.observed.items() if "language_model" in n or n.startswith("model.layers")]
    assert len(vision) == 3 and len(text) == 2, sorted(callback.observed)
    assert all(not c.reentrant for c in callback.observed.values())
    assert all(c.trainable for c in vision + text)
    # the text model's input carries the input-require-grad hook; the vision tower's patch embeddings do not, on
    # transformers 4.x (5.x hooks every sub-model's input embeddings)
    assert all(c.inputs_require_grad for c in text)
    assert all(c.inputs_require_grad is TF5 for c in vision[:1])


@pytest.mark.skipif(TF5, reason="transformers 5 hooks the vision tower's inputs too")
def test_a_vision_tower_losing_its_gradients_is_refused_before_the_backward():
    """LoRA on LLaVA's vision tower + `enable_input_require_grads()` + reentrant: transformers 4.57 hooks only the
    text embeddings, so the vision LoRA silently gets nothing (8 of 16 LoRA tensors train). No static fact can see
    it (the text embeddings carry the hook); the first forward does."""
    ref = run("llava", "lora_hooked", gc=False)
    bare = run("llava", "lora_hooked", use_reentrant=True)
    lost = ref.changed - bare.changed
    assert bare.error is None and lost and all("vision" in n for n in lost)
    strict = run("llava", "lora_hooked", use_reentrant=True, plugin="strict")
    assert strict.refused and not strict.changed_at_error
    (refusal,) = [d for d in strict.decisions if d.action == "error"]
    assert refusal.rule_id == "frozen-inputs-observed" and "vision_tower" in refusal.reason
    fixed = run("llava", "lora_hooked", use_reentrant=True, plugin="fix")
    assert fixed.error is None and ref.changed <= fixed.changed  # repaired from the first step on
    warned = run("llava", "lora_hooked", use_reentrant=True, plugin="warn")
    assert warned.changed == bare.changed  # warn mode changes nothing
    assert [d.rule_id for d in warned.decisions if d.action == "warn" and "observed" in d.rule_id]


def _custom_run(model, tmp_path, callbacks, **gc):
    args = TrainingArguments(**common_args(str(tmp_path), max_steps=2, gradient_checkpointing=True, **gc))
    trainer = Trainer(model=model, args=args, train_dataset=batches(), callbacks=callbacks)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    return [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]


def test_a_stack_that_checkpoints_its_plain_layers_itself(tmp_path):
    """Blocks that are not GradientCheckpointingLayers, checkpointed by their stack (Zamba-style): found from the
    function the checkpoint is handed, and judged like any other."""
    model = tiny(StackModel)
    model.embed.weight.requires_grad_(False)
    callback = SafeGCCallback()
    trained = _custom_run(model, tmp_path / "ok", [callback])
    assert {"stack.layers.0", "stack.layers.1"} <= set(callback.observed)
    assert sorted(trained) == sorted(n for n, p in model.named_parameters() if p.requires_grad)

    bare = tiny(StackModel)
    bare.embed.weight.requires_grad_(False)
    untrained = {n for n, p in bare.named_parameters() if p.requires_grad} - set(
        _custom_run(bare, tmp_path / "bare", None, gradient_checkpointing_kwargs={"use_reentrant": True}))
    strict = tiny(StackModel)
    strict.embed.weight.requires_grad_(False)
    if TF5:  # the Trainer's own input-require-grad hook (main_input_name == "input_ids") makes reentrant work
        assert untrained == set()
        _custom_run(strict, tmp_path / "strict", [SafeGCCallback()],
                    gradient_checkpointing_kwargs={"use_reentrant": True})
        return
    assert untrained == {"stack.layers.0.linear.weight", "stack.layers.0.linear.bias", "stack.layers.1.linear.weight",
                         "stack.layers.1.linear.bias"}
    with pytest.raises(GCConfigError, match=r"stack\.layers\.0"):
        _custom_run(strict, tmp_path / "strict", [SafeGCCallback()],
                    gradient_checkpointing_kwargs={"use_reentrant": True})


def test_the_pre_4_35_format_is_said_and_not_decided(tmp_path, plugin_log):
    model = tiny(LegacyModel)
    callback = SafeGCCallback()
    trained = _custom_run(model, tmp_path, [callback], gradient_checkpointing_kwargs={"use_reentrant": False})
    legacy = [d for d in callback.decisions if d.rule_id == "legacy-checkpointing-format"]
    assert legacy and legacy[0].action == "warn" and legacy[0].level == "warning"
    assert not [d for d in callback.decisions if d.setting == "use_reentrant" and d.applied]  # it decides nothing
    (audit,) = [d for d in callback.decisions if d.rule_id == "gradient-audit"]
    assert "not covered" in audit.reason  # said, not a false "all blocks received gradients"
    assert len(trained) == len([p for p in model.parameters() if p.requires_grad])


def test_an_observation_error_never_stops_training():
    model = build(__import__("zoo").BY_NAME["llama"], "full")

    def broken(call):
        raise RuntimeError("a plugin bug")

    # reentrant, without the input-require-grad hook transformers 5 adds in gradient_checkpointing_enable()
    model._set_gradient_checkpointing(True, functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True))
    model.get_input_embeddings().weight.requires_grad_(False)
    observation = Observation(model, Hooks(), broken)
    assert observation.install() == 1
    batch = __import__("zoo").lm_batch(0)
    model(**batch).loss.backward()  # the verdict raised inside: logged, training goes on
    assert observation.failures == 2 and not observation.pending  # one per block; both forwards went on
