"""Loops without a Trainer (issue 27): the model route (`trl_gc_plugin.routes.model_route`) runs the Trainer route's runtime for a
loop that calls `gradient_checkpointing_enable` itself (OpenRLHF, verl, accelerate and plain PyTorch loops).

Each outcome is measured against the same loop without the plugin: which decoder-layer tensors a real optimizer step
changes. With frozen input embeddings and `use_reentrant=True`, transformers 4.57 trains none of them, silently
(transformers 5 makes the inputs require grad itself when it enables checkpointing, and trains them all); a PEFT LoRA
model with reentrant checkpointing and no input hook fails at the first backward on 4.57. The plugin refuses those
before any update (strict) or repairs them (fix), through `guard(model)` or, under `install()` / `TRL_GC_PLUGIN=1`,
through the patched enable methods; it leaves what works as it is, keeps a value the user set, stays silent for a
model a Trainer manages, and leaves nothing behind.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from packaging.version import Version
from zoo import BY_NAME

import trl_gc_plugin
from trl_gc_plugin import GCConfigError
from trl_gc_plugin.model import hooks as _hooks
from trl_gc_plugin.model.ckpt import functions, keywords
from trl_gc_plugin.routes import model_route as loop
from trl_gc_plugin.testing import make_model

TF5 = Version(transformers.__version__) >= Version("5.0.0")
ARCHS = ("llama", "qwen2", "gpt2", "mixtral")


def frozen_embeddings(name: str):
    arch = BY_NAME[name]
    model = arch.build()
    model.get_input_embeddings().weight.requires_grad_(False)
    return model, arch.batch


def run_loop(model, batch, route: str | None, steps: int = 2, **guard_kwargs):
    """A plain PyTorch loop: enable checkpointing (reentrant), optionally `guard()`, SGD steps. Returns the names of
    the decoder-layer parameters the steps changed, and the error that stopped the loop (None if none)."""
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    error = None
    try:
        if route == "guard":
            trl_gc_plugin.guard(model, **guard_kwargs)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        for step in range(steps):
            loss = model(**batch(step)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    except (GCConfigError, RuntimeError) as exc:
        error = exc
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    return changed, error


def layer_params(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad and (".layers." in n or ".h." in n)}


@pytest.fixture
def patched():
    with trl_gc_plugin.installed(mode="strict"):
        yield
    assert not loop._patched


def broken_without_the_plugin(name: str) -> bool:
    """Whether the loop without the plugin leaves some decoder layer untrained (it never errors)."""
    model, batch = frozen_embeddings(name)
    changed, error = run_loop(model, batch, None)
    assert error is None
    return not layer_params(model) <= changed


def test_frozen_inputs_reentrant_without_the_plugin():
    """The failure the route guards, reproduced on Llama: transformers 4.57 trains no decoder layer; 5.x all."""
    model, batch = frozen_embeddings("llama")
    changed, error = run_loop(model, batch, None)
    assert error is None
    trained = changed & layer_params(model)
    assert (trained == layer_params(model)) if TF5 else not trained


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("route", ["guard", "patch"])
def test_frozen_inputs_reentrant_strict_refuses_before_any_update_or_trains(name, route, request):
    """Strict: refused before any update exactly where the plugin-free loop loses layers (Llama, Qwen2, Mixtral on
    4.57; GPT-2's learned position embeddings make its inputs require grad: it trains, and is left alone)."""
    broken = broken_without_the_plugin(name)
    if route == "patch":
        request.getfixturevalue("patched")
    model, batch = frozen_embeddings(name)
    changed, error = run_loop(model, batch, route, mode="strict") if route == "guard" else run_loop(model, batch, route)
    if broken:
        assert isinstance(error, GCConfigError) and "frozen-inputs" in str(error)
        assert not changed, "refused before any parameter update"
    else:  # the user's value is kept and every layer trains
        assert error is None and layer_params(model) <= changed
        assert all(keywords(f)["use_reentrant"] is True for _, f in functions(model))
    assert broken is (not TF5 and name != "gpt2")


@pytest.mark.parametrize("name", ARCHS)
def test_frozen_inputs_reentrant_fix_mode_trains_every_layer(name):
    model, batch = frozen_embeddings(name)
    with trl_gc_plugin.installed(mode="fix"):
        changed, error = run_loop(model, batch, "patch")
    assert error is None
    assert layer_params(model) <= changed


def test_guard_reads_the_model_and_returns_the_decisions():
    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    decisions = trl_gc_plugin.guard(model)
    assert decisions and all(d.action != "error" for d in decisions)
    assert all(keywords(f)["use_reentrant"] is False for _, f in functions(model))
    ids = torch.randint(3, 64, (2, 8))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the first step's checks run and go


def test_guard_without_checkpointing_says_so_and_decides_nothing(plugin_log):
    model = make_model()
    assert trl_gc_plugin.guard(model) == []
    assert "does not checkpoint" in plugin_log.text


def test_lora_reentrant_without_input_hook():
    """PEFT LoRA, reentrant, no `enable_input_require_grads()`: 4.57 fails at the first backward without the plugin;
    the plugin (fix) trains the adapters; 5.x trains them either way."""
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(0)
        return get_peft_model(make_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    def batch(step):
        ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    plain = build()
    changed, error = run_loop(plain, batch, None)
    lora = {n for n, p in plain.named_parameters() if p.requires_grad}
    if TF5:
        assert error is None and lora <= changed
    else:
        assert isinstance(error, RuntimeError) and "does not require grad" in str(error)
    with trl_gc_plugin.installed(mode="fix"):
        model = build()
        changed, error = run_loop(model, batch, "patch")
    assert error is None and {n for n, p in model.named_parameters() if p.requires_grad} <= changed


def test_a_value_the_user_set_is_kept():
    with trl_gc_plugin.installed(mode="strict"):
        model = make_model()
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model(input_ids=torch.randint(3, 64, (2, 8))).logits.sum().backward()
    assert all(keywords(f)["use_reentrant"] is True for _, f in functions(model))


@pytest.mark.skipif(not TF5, reason="the Gemma 4 KV-sharing failure needs transformers 5")
def test_kv_sharing_reentrant_refused_in_strict_repaired_in_fix():
    config = transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_kv_shared_layers=2, pad_token_id=0, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False,
    )

    def build():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()

    def batch(step):
        ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    with trl_gc_plugin.installed(mode="strict"):
        model = build()
        changed, error = run_loop(model, batch, "patch")
    assert isinstance(error, GCConfigError) and not changed
    with trl_gc_plugin.installed(mode="fix"):
        model = build()
        changed, error = run_loop(model, batch, "patch")
    assert error is None
    assert all(keywords(f)["use_reentrant"] is False for _, f in functions(model))


def test_accelerate_loop(tmp_path):
    """`Accelerator.prepare` and `accelerator.backward`, fix mode through `guard`, decisions in a file."""
    from accelerate import Accelerator

    model, batch = frozen_embeddings("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    decisions = trl_gc_plugin.guard(model, mode="fix", output_dir=str(tmp_path))
    accelerator = Accelerator(cpu=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    prepared, opt = accelerator.prepare(model, opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(2):
        accelerator.backward(prepared(**batch(step)).loss)
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert layer_params(model) <= changed
    written = json.loads((tmp_path / "gc_decisions.json").read_text())
    assert [d["rule_id"] for d in written][: len(decisions)] == [d.rule_id for d in decisions]


def test_a_trainer_owns_its_model_and_the_route_stays_silent(tmp_path, patched):
    from trainers import make_trainer

    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base = model
    assert loop._ROUTES.get(base) is not None  # armed by the enable call
    trainer = make_trainer("trainer", model, str(tmp_path))
    assert loop._ROUTES.get(base) is None  # claimed by the Trainer's callback at on_init_end
    trainer.train()
    emb = model.get_input_embeddings()
    assert not emb._forward_pre_hooks and not model._forward_pre_hooks


def test_nothing_stays_after_the_first_step_and_uninstall_restores_the_methods():
    from torch.optim import optimizer as torch_optimizer
    from transformers import PreTrainedModel

    originals = {name: PreTrainedModel.__dict__.get(name) for name in loop.ENABLE_METHODS}
    pre, post = (dict(torch_optimizer._global_optimizer_pre_hooks), dict(torch_optimizer._global_optimizer_post_hooks))
    with trl_gc_plugin.installed(mode="fix"):
        assert PreTrainedModel.__dict__["gradient_checkpointing_enable"] is not originals["gradient_checkpointing_enable"]
        model = make_model()
        _changed, error = run_loop(model, lambda s: {"input_ids": torch.randint(3, 64, (2, 8)),
                                                    "labels": torch.randint(3, 64, (2, 8))}, "patch")
        assert error is None
        assert dict(torch_optimizer._global_optimizer_pre_hooks) == pre
        assert dict(torch_optimizer._global_optimizer_post_hooks) == post
        assert not model.get_input_embeddings()._forward_pre_hooks
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.model.layers.modules())
    assert {name: PreTrainedModel.__dict__.get(name) for name in loop.ENABLE_METHODS} == originals


@pytest.mark.parametrize("wrapper", ["", "accelerate-"])
def test_ddp_loop_on_two_processes(tmp_path, wrapper):
    """torch DDP on 2 processes (gloo), by hand or by `Accelerator.prepare`: the loop without the plugin loses the
    decoder layers on 4.57 (silently, or DDP stops at the second step on parameters without a gradient); strict
    refuses on both ranks before any update; fix trains every layer, the ranks in sync."""
    from torchrun import run_scenarios

    by = run_scenarios("loop_scenarios.py", tmp_path, [wrapper + m for m in ("none", "strict", "fix")])
    none, strict, fix = by[wrapper + "none"], by[wrapper + "strict"], by[wrapper + "fix"]
    for rank in (0, 1):
        assert fix[rank]["outcome"] == "trained" and fix[rank]["layers_changed"] == fix[rank]["layers"]
        if TF5:
            assert none[rank]["layers_changed"] == none[rank]["layers"] and strict[rank]["outcome"] == "trained"
        else:
            assert none[rank]["outcome"] != "trained" or none[rank]["layers_changed"] == 0, none[rank]
            assert strict[rank]["outcome"].startswith("GCConfigError") and strict[rank]["layers_changed"] == 0
    assert fix[0]["checksum"] == pytest.approx(fix[1]["checksum"])


def test_a_copy_of_an_armed_model_does_not_start_the_route_and_carries_nothing_after(patched):
    """`copy.deepcopy` of a model between the enable call and the first forward (a reference model, a critic
    initialised from the actor): the route is armed at the model's class, by identity, so the copy's forward does not
    start the original's route."""
    import copy

    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    twin = copy.deepcopy(model)
    twin.train()
    ids = torch.randint(3, 64, (2, 8))
    twin(input_ids=ids, labels=ids).loss.backward()
    route = loop._ROUTES.get(model)
    assert route is not None and route.state == "new"  # still waiting for the original's first forward
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert route.state == "first step"
    route.end()


def test_checkpointing_turned_off_again_before_training_is_left_alone(patched, plugin_log):
    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.gradient_checkpointing_disable()
    model.train()
    ids = torch.randint(3, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert "trl_gc_plugin" not in plugin_log.text and not model.get_input_embeddings()._forward_pre_hooks


def test_the_last_enable_call_is_the_one_decided_for(patched):
    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not model.get_input_embeddings()._forward_pre_hooks  # armed at the model's class, not on the model
    # one route armed, not two: at the model's and its embeddings' classes
    assert sorted(_hooks.patched_classes()) == ["Embedding.__call__", "LlamaForCausalLM.__call__"]
    model.train()
    ids = torch.randint(3, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    route = loop._ROUTES.get(model)
    assert (route.run.reentrant.value, route.run.reentrant.source) == (False, "user")
    route.end()


def test_a_wrapper_that_calls_the_models_forward_directly_is_still_guarded(patched):
    """PEFT < 0.14's tuners run `self.model.forward(...)`, never the model's `__call__`: the route starts at the input
    embeddings' call instead (it once waited for a `__call__` that never came, and the loop trained unchecked)."""

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, **kwargs):
            return self.model.forward(**kwargs)

    model = make_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapper = Wrapper(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(3, 64, (2, 8))
    wrapper(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    route = loop._ROUTES.get(model)
    assert route.state == "done", route.state
    assert (route.run.reentrant.value, route.run.reentrant.source) == (False, "user")
    assert [d.action for d in route.run.decisions if d.rule_id == "gradient-audit"] == ["none"]
    route.end()


@pytest.mark.parametrize("reentrant", [True, False])
def test_qlora_loop_through_peft_prepare(tiny_checkpoint, reentrant, patched):
    """QLoRA as PEFT's docs set it up in a loop: `prepare_model_for_kbit_training` makes the enable call (reentrant
    gets PEFT's input hook), then LoRA; the plugin keeps the value, says that non-reentrant is preferred for a
    quantized model, and the adapters train."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from trainers import load_4bit, lora_config

    model = load_4bit(tiny_checkpoint)
    model = prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    model = get_peft_model(model, lora_config())
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in adapters}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    for step in range(2):
        ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in adapters)
    route = loop._ROUTES.get(trl_gc_plugin.model.ckpt.unwrap(model))
    said = {d.rule_id for d in route.run.decisions if d.action != "none"}
    assert (route.run.reentrant.value, route.run.reentrant.source) == (reentrant, "user")
    assert ("quantized-prefers-non-reentrant" in said) is reentrant
    assert all(keywords(f)["use_reentrant"] is reentrant for _, f in functions(model))


def test_nothing_of_the_plugin_in_what_the_loop_saves(tmp_path):
    """After a repaired loop (fix mode): the saved config is the one a plain loop saves, and a pickle of the whole
    model names nothing of the plugin (it loads where the plugin is not installed)."""
    import pickle

    def loop_and_save(plugin: str | None, out):
        model, batch = frozen_embeddings("llama")
        if plugin:
            with trl_gc_plugin.installed(mode=plugin):
                run_loop(model, batch, "patch")
        else:
            run_loop(model, batch, None)
        model.save_pretrained(out)
        return model

    def plugin_objects(model) -> list[str]:
        found = []
        for name, module in model.named_modules():
            hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
            values = [*vars(module).values(), *hooks]
            found += [f"{name}: {v!r}"[:120] for v in values
                      if (getattr(v, "__module__", "") or type(v).__module__).startswith("trl_gc_plugin")]
        return found

    plain = loop_and_save(None, tmp_path / "plain")
    fixed = loop_and_save("fix", tmp_path / "fixed")
    assert (tmp_path / "plain" / "config.json").read_text() == (tmp_path / "fixed" / "config.json").read_text()
    assert plugin_objects(fixed) == []
    try:  # transformers 5 hooks the embeddings with a local function: such a model does not pickle, plugin or not
        pickle.dumps(plain)
    except AttributeError:
        return
    assert b"trl_gc_plugin" not in pickle.dumps(fixed)


def test_a_refused_loop_leaves_no_optimizer_hook():
    """A refusal at the first forward removes the route's optimizer-step hook with its other checks: torch's steps
    pay nothing for a refused route (a notebook that fixes the setup and runs again). Before the first training
    forward the route holds no process-wide hook at all."""
    from torch.optim import optimizer as torch_optimizer

    pre, post = (dict(torch_optimizer._global_optimizer_pre_hooks), dict(torch_optimizer._global_optimizer_post_hooks))
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.detach())  # inputs never require grad
    trl_gc_plugin.guard(model, mode="strict")
    assert dict(torch_optimizer._global_optimizer_pre_hooks) == pre  # armed at the model's class only
    model.train()
    ids = torch.randint(3, 64, (2, 8))
    with pytest.raises(GCConfigError, match="frozen-inputs"):
        model(input_ids=ids, labels=ids)
    assert dict(torch_optimizer._global_optimizer_pre_hooks) == pre
    assert dict(torch_optimizer._global_optimizer_post_hooks) == post


# --- issue 46: a route that never sees an optimizer step leaves no hook, and says once the checks did not run ------


def optimizer_pre_hooks() -> int:
    from torch.optim import optimizer as torch_optimizer

    return len(torch_optimizer._global_optimizer_pre_hooks)


def not_run_lines(plugin_log) -> list[str]:
    return [r.getMessage() for r in plugin_log.records if "first-step checks did not run" in r.getMessage()]


def test_an_update_by_hand_ends_the_route_at_the_next_forward(plugin_log):
    """A loop that updates through `p.data` (no optimizer, no version-counter bump): the next forward ends the route,
    its optimizer pre-hook goes, and it says once that the first-step checks did not run."""
    before = optimizer_pre_hooks()
    ids = torch.randint(3, 64, (2, 8))
    with trl_gc_plugin.installed(mode="fix"):
        model = make_model()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            for p in model.parameters():
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-0.1)
                    p.grad = None
        assert optimizer_pre_hooks() == before and _hooks.waiting() == 0
        assert len(not_run_lines(plugin_log)) == 1 and "without a torch optimizer step" in not_run_lines(plugin_log)[0]


def test_gradient_accumulation_keeps_the_route_until_the_step(plugin_log):
    """Several forwards and backwards before the first optimizer step change no parameter: the route waits, and the
    step runs the checks."""
    ids = torch.randint(3, 64, (2, 8))
    with trl_gc_plugin.installed(mode="fix"):
        model = make_model()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
        assert loop._ROUTES.get(model).state == "first step"
        opt.step()
        assert loop._ROUTES.get(model).state == "done"
    assert not_run_lines(plugin_log) == []


def test_a_frozen_reference_model_in_train_mode_arms_nothing(plugin_log):
    """A reference model (`requires_grad_(False)`, checkpointing on, train mode, grad enabled): no optimizer step
    will ever come for it; its route ends at its first forward, says so once, and registers no hook."""
    before = optimizer_pre_hooks()
    ids = torch.randint(3, 64, (2, 8))
    with trl_gc_plugin.installed(mode="fix"):
        ref = make_model()
        ref.requires_grad_(False)
        ref.gradient_checkpointing_enable()
        ref.train()
        for _ in range(2):
            ref(input_ids=ids, labels=ids)
            assert optimizer_pre_hooks() == before and _hooks.waiting() == 0
        assert len(not_run_lines(plugin_log)) == 1 and "no trainable parameter" in not_run_lines(plugin_log)[0]


def test_a_lora_loop_that_crashes_in_warn_mode_leaves_no_hook(plugin_log):
    """PEFT LoRA, reentrant, no input hook, warn mode: transformers 4.57 fails at the first backward, plugin or not
    (warn changes nothing); the forward whose logits cannot require grad ends the route there. Transformers 5 trains."""
    from peft import LoraConfig, get_peft_model

    before = optimizer_pre_hooks()
    ids = torch.randint(3, 64, (2, 8))
    with trl_gc_plugin.installed(mode="warn"):
        model = get_peft_model(make_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        error = None
        try:
            for _ in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
        except RuntimeError as exc:
            error = exc
        assert (error is None) is TF5
        assert optimizer_pre_hooks() == before and _hooks.waiting() == 0
        if not TF5:
            assert len(not_run_lines(plugin_log)) == 1 and "do not require grad" in not_run_lines(plugin_log)[0]
