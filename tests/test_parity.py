"""The bounded parity probe (parity.py): same verdicts as an exact comparison, bounded memory, no side effects.

`exact_probe` below is the probe the plugin ran before (two float32 copies of every gradient, compared element by
element); the fingerprint probe must reach the same verdict on every zoo architecture and variant, while its extra
memory stays far below one copy of the gradients."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from zoo import BY_NAME, TF
from zoo_run import build

from trl_gc_plugin.model import ckpt
from trl_gc_plugin.model.hooks import Hooks
from trl_gc_plugin.planning.memory import live_bytes
from trl_gc_plugin.runtime import parity

TF5 = TF.major >= 5


def exact_probe(model, inputs, seed=0):
    """The element-wise comparison: (names missing with checkpointing, max |diff| <= 1e-6 + 1e-4 * max|g|)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flagged = [m for m in ckpt.unwrap(model).modules() if getattr(m, "gradient_checkpointing", None) is True]
    args, kwargs = inputs

    def run(on):
        for m in flagged:
            m.gradient_checkpointing = on
        for _, p in params:
            p.grad = None
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            scalar = parity._scalar(model(*args, **kwargs), seed)
            if scalar is not None:
                scalar.backward()
        return {n: None if p.grad is None else p.grad.detach().float().clone() for n, p in params}

    try:
        with_gc, without = run(True), run(False)
    finally:
        for m in flagged:
            m.gradient_checkpointing = True
        for _, p in params:
            p.grad = None
    missing, worst, scale = [], 0.0, 0.0
    for name, ref in without.items():
        if ref is None or not ref.any():
            continue
        scale = max(scale, float(ref.abs().max()))
        got = with_gc[name]
        if got is None or not got.any():
            missing.append(name)
            continue
        worst = max(worst, float((got - ref).abs().max()))
    return missing, not missing and worst <= 1e-6 + 1e-4 * scale


def enabled(model, reentrant):
    ckpt.unwrap(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


ZOO_CASES = [
    (arch, variant, reentrant)
    for arch in ("llama", "gpt2", "mixtral", "llama_seq_cls", "bert_seq_cls", "t5", "bart", "llava", "qwen2_vl")
    for variant in ("full", "frozen_emb", "lora")
    for reentrant in (True, False)
]


@pytest.mark.parametrize(("arch", "variant", "reentrant"), ZOO_CASES)
def test_same_verdict_as_the_exact_comparison(arch, variant, reentrant):
    model = enabled(build(BY_NAME[arch], variant), reentrant)
    batch = BY_NAME[arch].batch(0)
    inputs = parity.first_sample((), batch) if arch != "qwen2_vl" else ((), batch)  # flattened patches: whole batch
    try:
        missing, ok = exact_probe(model, inputs)
    except Exception as exc:  # the setup does not run under checkpointing at all (no verdict to compare)
        pytest.skip(f"does not run: {type(exc).__name__}: {exc}")
    result = parity.parity_probe(model, parity.first_sample((), batch), ((), batch))
    assert result.skipped is None, result.skipped
    assert sorted(result.missing_with_checkpointing) == sorted(missing)
    assert result.ok == ok, (result, missing)
    assert result.compared > 0 or missing


@pytest.mark.skipif(not TF5, reason="Gemma 4 (shared KV states) is in transformers 5")
def test_wrong_gradients_from_shared_kv_states_are_seen():
    from test_rules_v2 import shared_kv_model

    model = enabled(shared_kv_model(), True)
    result = parity.parity_probe(model)
    assert not result.ok and result.outside and result.max_rel > 0.1
    assert result.batch.startswith("synthetic")
    exact = enabled(shared_kv_model(), False)
    assert parity.parity_probe(exact).ok


def test_all_zero_gradients_with_checkpointing_count_as_missing():
    """A side input set by a hook and cleared before the recompute (the aLoRA pattern): zeros, not None."""

    class Scaled(nn.Module):
        def __init__(self, inner, state):
            super().__init__()
            self.inner, self.state = inner, state
            self.gate = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return self.inner(x) + self.gate * self.state.get("scale", torch.zeros(())) * x

    model = enabled(build(BY_NAME["llama"], "full"), True)  # reentrant: the recompute runs in the backward
    state: dict[str, float] = {}
    for layer in model.model.layers:
        layer.mlp = Scaled(layer.mlp, state)
    model.register_forward_pre_hook(lambda m, a: state.update(scale=torch.ones(())))
    model.register_forward_hook(lambda m, a, o: state.clear())
    result = parity.parity_probe(model)
    assert {n for n in result.missing_with_checkpointing} == {f"model.layers.{i}.mlp.gate" for i in range(2)}


def big_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return enabled(LlamaForCausalLM(config), True)


def test_extra_memory_is_bounded_by_the_largest_gradient_not_the_model():
    model = big_model()
    ids = torch.randint(1024, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()  # the run's own gradients, as at the first optimizer step
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert largest < 0.1 * param_bytes
    inputs = parity.first_sample((), {"input_ids": ids, "labels": ids})
    with live_bytes() as old:
        exact_probe(model, inputs)
    model.zero_grad(set_to_none=False)
    model(input_ids=ids, labels=ids).loss.backward()
    with live_bytes() as new:
        result = parity.parity_probe(model, inputs)
    assert result.ok and result.compared == len(list(model.parameters()))
    assert old.peak > param_bytes  # the measurement sees what a copy of the gradients costs
    # what is left is the reference pass's activations of 16 tokens and one gradient in flight
    assert new.peak < 0.3 * param_bytes and new.peak * 4 < old.peak, (new.peak, old.peak, largest, param_bytes)


class RunningStats(nn.Module):
    """A BatchNorm-style running statistic and a counter updated in the forward."""

    def __init__(self, hidden):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(hidden))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(dim=(0, 1)))
                self.num_batches_tracked += 1
        return x


def test_the_run_sees_nothing_of_the_probe():
    model = big_model()
    stats = RunningStats(256)
    model.model.layers[0].input_layernorm.register_forward_hook(lambda m, a, o: stats(o))
    model.model.layers[0].add_module("stats", stats)
    ids = torch.randint(1024, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    values = {n: g.clone() for n, g in grads.items()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    tracked = int(stats.num_batches_tracked)  # 2: the reentrant recompute replays the forward's side effect
    optimizer = torch.optim.AdamW(model.parameters())
    cpu_rng = torch.get_rng_state()
    model.eval()
    result = parity.parity_probe(model, parity.first_sample((), {"input_ids": ids, "labels": ids}))
    assert result.ok and result.skipped is None
    assert torch.equal(torch.get_rng_state(), cpu_rng)
    assert not model.training
    for name, param in model.named_parameters():  # the accumulated gradients, as the same tensors, unchanged
        assert param.grad is grads[name] and torch.equal(param.grad, values[name])
        assert not param._post_accumulate_grad_hooks
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert int(stats.num_batches_tracked) == tracked
    assert not optimizer.state
    assert not torch.nn.modules.module._global_forward_hooks


@pytest.mark.parametrize("arch", ["t5", "llama_seq_cls", "llava", "whisper"])
def test_any_model_gets_the_probe_by_default_on_its_first_batch(arch, tmp_path):
    from zoo_run import run

    outcome = run(arch, "full", use_reentrant=True, plugin="fix")
    (decision,) = [d for d in outcome.decisions if d.rule_id == "parity-check"]
    if arch == "whisper" and not TF5:  # the plugin switched it to non-reentrant at the first forward (keyword inputs)
        assert decision.action == "none"
    assert decision.action == "none", decision.reason
    assert "first training batch" in decision.reason


def hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_first_inputs_leave_nothing_on_copies_of_the_model():
    model = big_model()
    plain = hooks(copy.deepcopy(model))
    try:
        plain_pickle = pickle.dumps(model)
    except (AttributeError, pickle.PicklingError):  # transformers 5's input-require-grad hook is a local function
        plain_pickle = None
    watch = parity.FirstInputs(model)
    run_hooks = Hooks()
    watch.install(run_hooks)
    assert hooks(copy.deepcopy(model)) == plain
    if plain_pickle is not None:
        assert b"trl_gc_plugin" not in pickle.dumps(model)
    ids = torch.randint(1024, (2, 80))
    model(input_ids=ids, labels=ids)
    assert watch.inputs is not None and watch.inputs[1]["input_ids"].shape == (1, parity.MAX_TOKENS)
    assert not torch.nn.modules.module._global_forward_hooks  # gone after the first forward
    assert len(run_hooks) == 0
    assert hooks(model) == plain
