"""Rule table v2: each failure reproduced without the plugin, then the plugin's outcome (strict / fix), on the
transformers lines where it applies."""

from __future__ import annotations

import functools

import pytest
import torch
from trainers import TF5, common_args, make_trainer
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from zoo_run import run

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.core import capabilities
from trl_gc_plugin.model import probe
from trl_gc_plugin.model.probe import block_pattern
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

READS = capabilities.installed().layer_kwargs()
"""The layer kwargs the installed transformers reads itself: every_n_layers from 5.16, offload from 5.17."""


class PatternSeen:
    """The per-block checkpointing flags every training forward of `model` runs with."""

    def __init__(self, model):
        self.seen = []
        model.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if module.training and torch.is_grad_enabled():
            self.seen.append(block_pattern(module))


def runs_pattern(seen, pattern, parity_probe):
    """Every training forward ran `pattern`, except the parity probe's one reference forward with checkpointing off
    (on by default for reentrant causal LMs; its checkpointed forward runs the pattern too)."""
    off = [p for p in seen if not any(p)]
    assert len(off) == (1 if parity_probe else 0), seen
    return len(seen) >= 3 and all(p == pattern for p in seen if any(p))


def four_layers():
    return make_model(num_hidden_layers=4)


def _grpo(kwargs, callbacks, tmp_path, max_steps=2):
    model = four_layers()
    seen = PatternSeen(model)
    trainer = make_trainer("grpo", model, str(tmp_path), gc_kwargs=kwargs, callbacks=callbacks, max_steps=max_steps)
    try:
        trainer.train()
    except Exception as exc:
        return seen.seen, f"{type(exc).__name__}: {exc}", trainer
    return seen.seen, None, trainer


# --- 1. every_n_layers lost across TRL's per-step re-enables (transformers >= 5.16) -----------------------------


@pytest.mark.skipif("every_n_layers" not in READS, reason="every_n_layers is a transformers >= 5.16 setting")
def test_every_n_layers_is_lost_by_grpos_re_enables_without_the_plugin(tmp_path):
    seen, error, _ = _grpo({"use_reentrant": False, "every_n_layers": 2}, None, tmp_path / "a")
    assert error is None and seen and all(p == (True,) * 4 for p in seen)  # asked [1,0,1,0], ran [1,1,1,1]
    _, error, _ = _grpo({"use_reentrant": True, "every_n_layers": 2}, None, tmp_path / "b")
    assert error is not None and "Unexpected keyword arguments: every_n_layers" in error


@pytest.mark.skipif("every_n_layers" not in READS, reason="every_n_layers is a transformers >= 5.16 setting")
@pytest.mark.parametrize("reentrant", [False, True])
def test_the_plugin_keeps_the_pattern_across_re_enables(reentrant, tmp_path):
    callback = SafeGCCallback()
    seen, error, trainer = _grpo({"use_reentrant": reentrant, "every_n_layers": 2}, [callback], tmp_path, 3)
    assert error is None, error
    assert runs_pattern(seen, (True, False, True, False), parity_probe=reentrant)
    assert "gradient_checkpointing_enable" not in trainer.model.__dict__  # the guard is gone after training
    assert not [d for d in callback.decisions if d.rule_id == "checkpointing-drift"]


# --- 2. every_n_layers / offload before transformers 5.16 ------------------------------------------------------


@pytest.mark.skipif(bool(READS), reason="transformers >= 5.16 reads every_n_layers itself")
def test_every_n_layers_before_5_16_without_and_with_the_plugin(tmp_path):
    def trainer(kwargs, callbacks, out):
        model = four_layers()
        seen = PatternSeen(model)
        return seen, make_trainer("trainer", model, str(tmp_path / out), gc_kwargs=kwargs, callbacks=callbacks)

    seen, bare = trainer({"use_reentrant": False, "every_n_layers": 2}, None, "bare")
    bare.train()
    assert seen.seen and all(p == (True,) * 4 for p in seen.seen)  # silently ignored: every layer checkpointed
    _, crashing = trainer({"use_reentrant": True, "every_n_layers": 2}, None, "crash")
    with pytest.raises(ValueError, match="Unexpected keyword arguments: every_n_layers"):
        crashing.train()

    callback = SafeGCCallback()
    seen, plugged = trainer({"use_reentrant": True, "every_n_layers": 2, "offload": True}, [callback], "plugin")
    (repair,) = [d for d in callback.decisions if d.rule_id == "layer-kwargs-unsupported"]
    assert repair.action == "repair" and repair.level == "warning" and repair.before == ("every_n_layers", "offload")
    assert "every_n_layers" not in plugged.args.gradient_checkpointing_kwargs  # torch never gets them
    plugged.train()
    assert runs_pattern(seen.seen, (True, False, True, False), parity_probe=True)  # applied by the plugin


# --- 3. offload without an accelerator ------------------------------------------------------------------------


@pytest.mark.skipif(
    "offload" not in READS or probe.accelerator_usable(), reason="transformers >= 5.17 on a machine without a GPU"
)
def test_offload_without_an_accelerator(tmp_path):
    """transformers' `offload=True` pins its saved inputs: torch built without an accelerator backend refuses that in
    the first forward; a CUDA build on a machine without a GPU pins nothing and trains, and the plugin leaves it."""
    kwargs = {"use_reentrant": False, "offload": True}
    bare = make_trainer("trainer", make_model(), str(tmp_path / "bare"), gc_kwargs=kwargs)
    if probe.accelerator_built():
        bare.train()
        make_trainer("trainer", make_model(), str(tmp_path / "plugin"), gc_kwargs=kwargs,
                     callbacks=[SafeGCCallback()]).train()
        return
    with pytest.raises(RuntimeError, match="pin_memory"):
        bare.train()
    with pytest.raises(GCConfigError, match="offload-needs-accelerator"):
        make_trainer("trainer", make_model(), str(tmp_path / "strict"), gc_kwargs=kwargs,
                     callbacks=[SafeGCCallback()])
    fixed = make_trainer("trainer", make_model(), str(tmp_path / "fix"), gc_kwargs=kwargs,
                         callbacks=[SafeGCCallback(mode="fix")])
    assert "offload" not in getattr(fixed.args, "activation_checkpointing_kwargs", fixed.args.gradient_checkpointing_kwargs)
    fixed.train()


# --- helpers: gradients of one batch with given checkpointing kwargs (None: no checkpointing) --------------------


def grads(model, kwargs, batch, seed=123):
    model.zero_grad(set_to_none=True)
    if kwargs is None:
        model.gradient_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs))
    model.train()
    torch.manual_seed(seed)
    model(**batch).loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.gradient_checkpointing_disable()
    return out


def worst_relative_difference(got, ref):
    assert set(got) == set(ref)
    return max(float((got[n] - ref[n]).abs().max() / (ref[n].abs().max() + 1e-12)) for n in ref)


def batch_of_ids(vocab=60):
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def trainer_on(model, tmp_path, kwargs, callbacks):
    data = [{k: v[0] for k, v in batch_of_ids().items()}] * 4
    args = TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True,
                                           gradient_checkpointing_kwargs=kwargs))
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


# --- 6. layers that share state (cross-layer KV sharing) ------------------------------------------------------


def shared_kv_model():
    import transformers

    if TF5:
        config = transformers.Gemma4TextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_kv_shared_layers=2, pad_token_id=0, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * 2)
    else:
        config = transformers.Gemma3nTextConfig(
            vocab_size=64, vocab_size_per_layer_input=64, hidden_size=32, hidden_size_per_layer_input=8,
            intermediate_size=[64] * 4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_kv_shared_layers=2, laurel_rank=4, altup_num_inputs=2, pad_token_id=0,
            activation_sparsity_pattern=[0.0] * 4, layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def test_shared_layer_state_under_reentrant_checkpointing(tmp_path):
    model, batch = shared_kv_model(), batch_of_ids()
    ref = grads(model, None, batch)
    reentrant = worst_relative_difference(grads(model, {"use_reentrant": True}, batch), ref)
    assert worst_relative_difference(grads(model, {"use_reentrant": False}, batch), ref) == 0
    if not TF5:  # Gemma 3n on 4.57.6: not reproduced, so the plugin keeps an explicit value with a warning
        assert reentrant == 0
        callback = SafeGCCallback()
        trainer_on(model, tmp_path, {"use_reentrant": True}, [callback])
        (kept,) = [d for d in callback.decisions if d.rule_id == "shared-layer-state-prefers-non-reentrant"]
        assert kept.action == "warn" and kept.after is True
        return
    assert reentrant > 0.1  # silently wrong: every parameter still gets a gradient (the audit passes)
    with pytest.raises(GCConfigError, match="shared-layer-state-needs-non-reentrant"):
        trainer_on(model, tmp_path / "strict", {"use_reentrant": True}, [SafeGCCallback()])
    fixed = trainer_on(model, tmp_path / "fix", {"use_reentrant": True}, [SafeGCCallback(mode="fix")])
    decided = getattr(fixed.args, "activation_checkpointing_kwargs", fixed.args.gradient_checkpointing_kwargs)
    assert decided == {"use_reentrant": False}
    assert worst_relative_difference(grads(model, decided, batch), ref) == 0


# --- 7. preserve_rng_state=False with dropout ----------------------------------------------------------------


def dropout_model():
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1, embd_pdrop=0.1,
                                      attn_pdrop=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


@pytest.mark.parametrize("reentrant", [False, True])
def test_preserve_rng_state_false_with_dropout(reentrant, tmp_path):
    model, batch = dropout_model(), batch_of_ids()
    ref = grads(model, None, batch)
    asked = {"use_reentrant": reentrant, "preserve_rng_state": False}
    assert worst_relative_difference(grads(model, asked, batch), ref) > 0.1  # silently wrong without the plugin
    # the same dropout masks: equal up to float rounding (8.9e-8 / 9.5e-8 relative on this machine's CPU, 0 on
    # others), against > 0.1 without the RNG state
    assert worst_relative_difference(grads(model, {**asked, "preserve_rng_state": True}, batch), ref) < 1e-6
    with pytest.raises(GCConfigError, match="preserve-rng-state-with-dropout"):
        trainer_on(model, tmp_path / "strict", asked, [SafeGCCallback()])
    fixed = trainer_on(model, tmp_path / "fix", asked, [SafeGCCallback(mode="fix")])
    decided = fixed.args.gradient_checkpointing_kwargs
    assert decided["preserve_rng_state"] is True
    assert worst_relative_difference(grads(model, decided, batch), ref) < 1e-6
    # without dropout the same value is harmless and kept
    quiet = make_model()
    callback = SafeGCCallback()
    trainer_on(quiet, tmp_path / "quiet", asked, [callback])
    assert not [d for d in callback.decisions if d.rule_id == "preserve-rng-state-with-dropout"]


def moe_model(kind: str):
    import transformers

    extra = ({"num_local_experts": 4, "num_experts_per_tok": 2} if kind == "mixtral" else
             {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8})
    config = getattr(transformers, "MixtralConfig" if kind == "mixtral" else "Qwen3MoeConfig")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, router_jitter_noise=0.1, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_router_jitter_is_a_random_op_where_the_model_uses_it(kind, tmp_path):
    """Mixtral multiplies its router input by uniform noise in training (`router_jitter_noise`): with
    preserve_rng_state=False the recompute draws other noise, silently 0.47 off; the rule refuses it (strict) or sets
    the RNG state back (fix); on transformers 4.57, whose expert loop is shaped by the routing, the same recompute
    stops with a CheckpointError. Qwen3-MoE's config accepts the key, its model never uses it: nothing is said."""
    from torch.utils.checkpoint import CheckpointError

    model, batch = moe_model(kind), batch_of_ids()
    ref = grads(model, None, batch)
    asked = {"use_reentrant": False, "preserve_rng_state": False}
    try:
        off = worst_relative_difference(grads(model, asked, batch), ref)
    except CheckpointError:  # transformers 4.57's expert loop: other noise routes other tokens, other shapes
        off = float("inf")
    callback = SafeGCCallback()
    if kind == "qwen3_moe":
        assert off < 1e-6
        trainer_on(model, tmp_path / "quiet", asked, [callback])
        assert not [d for d in callback.decisions if d.rule_id == "preserve-rng-state-with-dropout"]
        return
    assert off > 0.1
    with pytest.raises(GCConfigError, match="preserve-rng-state-with-dropout"):
        trainer_on(model, tmp_path / "strict", asked, [callback])
    fixed = trainer_on(model, tmp_path / "fix", asked, [SafeGCCallback(mode="fix")])
    decided = fixed.args.gradient_checkpointing_kwargs
    assert decided["preserve_rng_state"] is True
    assert worst_relative_difference(grads(model, decided, batch), ref) < 1e-6


# --- 11. options only the non-reentrant implementation has -----------------------------------------------------


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)


def test_context_fn_needs_non_reentrant(tmp_path):
    bare = trainer_on(make_model(), tmp_path / "bare", {"use_reentrant": True, "context_fn": selective()}, None)
    with pytest.raises(ValueError, match="only supported when use_reentrant=False"):
        bare.train()
    with pytest.raises(GCConfigError, match="non-reentrant-only-kwargs"):
        trainer_on(make_model(), tmp_path / "strict", {"use_reentrant": True, "context_fn": selective()},
                   [SafeGCCallback()])
    unset = trainer_on(make_model(), tmp_path / "unset", {"context_fn": selective()}, [SafeGCCallback()])
    assert unset.args.gradient_checkpointing_kwargs["use_reentrant"] is False
    unset.train()


# --- reentrant blocks sharing a keyword tensor (found by the zoo: Whisper on transformers 4.57) -----------------


def test_reentrant_blocks_sharing_a_keyword_tensor(tmp_path):
    bare = run("whisper", "full", use_reentrant=True)
    strict = run("whisper", "full", use_reentrant=True, plugin="strict")
    fixed = run("whisper", "full", use_reentrant=True, plugin="fix")
    unset = run("whisper", "full", plugin="warn")  # the library default: reentrant on 4.x
    if TF5:  # 5.x passes encoder_hidden_states positionally: nothing to find
        assert bare.error is None and strict.error is None
        assert not [d for d in strict.decisions if d.rule_id == "reentrant-keyword-inputs"]
        return
    assert bare.error and "backward through the graph a second time" in bare.error
    assert unset.error and "backward through the graph a second time" in unset.error  # warn mode changes nothing
    assert strict.refused and not strict.changed_at_error
    (refusal,) = [d for d in strict.decisions if d.action == "error"]
    assert refusal.rule_id == "reentrant-keyword-inputs" and "encoder_hidden_states" in refusal.reason
    ref = run("whisper", "full", gc=False)
    assert fixed.error is None and ref.changed <= fixed.changed  # fix: the first step already trained everything
    assert [d.action for d in fixed.decisions if d.rule_id == "reentrant-keyword-inputs"] == ["override"]


# --- 4. checkpointing asked for vs running -----------------------------------------------------------------


class EvalModeTrainer(Trainer):
    """A custom training step that switches dropout off the way some RL code does: `model.eval()`."""

    def compute_loss(self, model, inputs, **kwargs):
        model.eval()
        return super().compute_loss(model, inputs, **kwargs)


class Recomputes:
    """How many times block 0's MLP ran beyond once per forward of the model: its recomputes in backward passes
    (a hook on the MLP, a submodule, fires inside a recompute on every transformers version)."""

    def __init__(self, model):
        self.mlp = self.forwards = 0
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: self._add("mlp"))
        model.register_forward_pre_hook(lambda *a: self._add("forwards"))

    def _add(self, name):
        setattr(self, name, getattr(self, name) + 1)

    @property
    def count(self):
        return self.mlp - self.forwards


def test_checkpointing_asked_for_but_not_running(tmp_path):
    def eval_trainer(callbacks, out):
        model = make_model()
        recomputes = Recomputes(model)
        args = TrainingArguments(**common_args(str(tmp_path / out), gradient_checkpointing=True))
        trainer = EvalModeTrainer(model=model, args=args, train_dataset=tokenized_dataset(make_tokenizer()),
                                  callbacks=callbacks)
        trainer.train()
        return recomputes.count

    assert eval_trainer(None, "bare") == 0  # without the plugin: asked for, silently not running
    callback = SafeGCCallback()
    assert eval_trainer([callback], "plugin") == 0
    (said,) = [d for d in callback.decisions if d.rule_id == "checkpointing-not-running"]
    assert said.action == "warn" and said.level == "warning" and "eval mode" in said.reason


def test_checkpointing_running_but_not_asked_for(tiny_checkpoint, tmp_path):
    from peft import get_peft_model, prepare_model_for_kbit_training
    from trainers import load_4bit, lora_config

    def qlora():
        model = prepare_model_for_kbit_training(load_4bit(tiny_checkpoint))  # switches checkpointing on
        return get_peft_model(model, lora_config())

    model = qlora()
    recomputes = Recomputes(model.base_model.model)
    make_trainer("trainer", model, str(tmp_path / "bare"), gc=False).train()
    assert recomputes.count > 0  # not asked for, running: every step pays the recompute
    callback = SafeGCCallback()
    make_trainer("trainer", qlora(), str(tmp_path / "plugin"), gc=False, callbacks=[callback]).train()
    (said,) = [d for d in callback.decisions if d.rule_id == "checkpointing-unasked"]
    assert said.level == "info" and "prepare_model_for_kbit_training" in said.reason


# --- 5. use_cache off in every config while training, as the user had it otherwise ----------------------------


def test_use_cache_in_sub_configs(tmp_path):
    from zoo import BY_NAME
    from zoo_run import build

    model = build(BY_NAME["llava"], "full")
    configs = {id(c): c for c in [model.config, model.config.text_config, model.config.vision_config]
               if hasattr(c, "use_cache")}
    text = model.config.text_config
    assert text.use_cache is True
    seen = []
    model.model.language_model.register_forward_pre_hook(
        lambda module, args: seen.append(module.config.use_cache) if module.training else None)
    bare = build(BY_NAME["llava"], "full")
    assert run("llava", "full", model=bare).error is None
    outcome = run("llava", "full", model=model, plugin="strict")
    assert outcome.error is None and seen and not any(seen)  # the language model trained without a cache
    for config in configs.values():  # and every config is as a run without the plugin leaves it
        other = {id(model.config): bare.config, id(text): bare.config.text_config}.get(id(config))
        if other is not None:
            assert config.use_cache == other.use_cache


# --- 12. Unsloth: the plugin stands back from deciding; its runtime checks still run ----------------------------


def test_under_unsloth_the_runtime_checks_still_run(tmp_path, monkeypatch):
    """Unsloth cannot be installed without a GPU; an empty module named `unsloth` in `sys.modules` is what the
    plugin's fact reads (`"unsloth" in sys.modules`), so it stands in for the import here."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "unsloth", types.ModuleType("unsloth"))
    callback = SafeGCCallback()
    trainer = make_trainer("trainer", make_model(), str(tmp_path), gc_kwargs={"use_reentrant": True},
                           callbacks=[callback])
    assert [d.rule_id for d in callback.decisions if d.stage == "init_end"] == ["unsloth-owns-checkpointing"]
    assert trainer.args.gradient_checkpointing_kwargs == {"use_reentrant": True}  # nothing decided
    trainer.train()
    assert [d.action for d in callback.decisions if d.rule_id == "gradient-audit"] == ["none"]  # the audit ran
    assert callback.observed  # the first forward was observed


# --- 13. torch's newer keyword: respect_saved_tensors_hooks (2.14+), non-reentrant only ---------------------------


@pytest.mark.parametrize("mode", ["strict", "fix"])
def test_respect_saved_tensors_hooks_with_reentrant(mode, tmp_path):
    """`respect_saved_tensors_hooks` with `use_reentrant=True` ends in torch's ValueError at the first forward without
    the plugin, on every torch (2.13: an unknown keyword; 2.14+: one only non-reentrant checkpointing takes, which the
    unknown-key rules stayed silent on once torch's signature had it). With the plugin, strict refuses before any
    update and fix trains: on 2.14+ it switches to non-reentrant and keeps the key (`non-reentrant-only-kwargs`), on
    2.13 it removes the key nothing reads (`checkpointing-kwargs-unknown-reentrant`)."""
    kwargs = {"use_reentrant": True, "respect_saved_tensors_hooks": False}
    known = "respect_saved_tensors_hooks" in capabilities.torch_checkpoint_keywords()
    rule = "non-reentrant-only-kwargs" if known else "checkpointing-kwargs-unknown-reentrant"
    with pytest.raises(ValueError, match="respect_saved_tensors_hooks"):
        make_trainer("trainer", make_model(), str(tmp_path / "bare"), gc_kwargs=dict(kwargs), max_steps=1).train()
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = SafeGCCallback(mode=mode)
    if mode == "strict":
        with pytest.raises(GCConfigError, match=rule):
            make_trainer("trainer", model, str(tmp_path), gc_kwargs=kwargs, callbacks=[callback]).train()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return
    trainer = make_trainer("trainer", model, str(tmp_path), gc_kwargs=kwargs, callbacks=[callback], max_steps=1)
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert [d.action for d in callback.decisions if d.rule_id == rule] == ["override"]
