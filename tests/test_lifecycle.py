"""One run lifecycle for every route (issue 37): settings resolved once before anything is armed, every hook through
one registry that removes it on every exit path, nothing on a copy or a pickle of the model, one policy for one input
whatever the route, and re-enables watched on the model route as on the Trainer route.

Each test reproduces a defect of the routes' separate lifecycles (it failed before the one-lifecycle redesign) and
measures the outcome against the same loop without the plugin where training is involved: which tensors an optimizer
step changes, and whether `torch.save` of the model works.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import pickle
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import Trainer, TrainingArguments

import trl_gc_plugin
from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

TF5 = Version(transformers.__version__) >= Version("5.0.0")
PLUGIN = "trl_gc_plugin"


@contextlib.contextmanager
def env_route(monkeypatch, targets=("transformers.modeling_utils",), **env):
    """`TRL_GC_PLUGIN=1` in this process: what the start-up hook does once `targets` are imported (a plain loop imports
    `modeling_utils` only), with the plugin's variables set to `env`."""
    from trl_gc_plugin import _startup

    monkeypatch.setenv("TRL_GC_PLUGIN", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in targets:
        __import__(name)
        _startup._patch(name, sys.modules[name])
    try:
        yield
    finally:
        trl_gc_plugin.uninstall()


def frozen_model():
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    model.train()
    return model


def batch(step: int = 0):
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def layer_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad and ".layers." in n}


def sgd_loop(model, steps: int = 2, reenable: dict | None = None, manual: bool = False):
    """SGD steps on `model`; `reenable`: call `gradient_checkpointing_enable(gradient_checkpointing_kwargs=reenable)`
    again before every step after the first (a loop that re-enables); `manual`: update without a torch optimizer.
    Returns the names of the parameters the steps changed."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        if reenable is not None and step:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(reenable))
        model(**batch(step)).loss.backward()
        if manual:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                        p.grad = None
        else:
            opt.step()
            opt.zero_grad()
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def plugin_hooks(model) -> list[str]:
    """Hooks defined by the plugin found in the hook tables of any module of `model`."""
    found = []
    for name, module in model.named_modules():
        for table in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            for hook in getattr(module, table, {}).values():
                if getattr(hook, "__module__", "").startswith(PLUGIN) or PLUGIN in repr(hook):
                    found.append(f"{name or '<model>'}.{table}: {getattr(hook, '__qualname__', hook)!r}")
    return found


def global_hooks() -> dict[str, int]:
    """The plugin's process-wide torch hooks: module forward hooks and optimizer step hooks."""
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    tables = {
        "module_pre": torch_module._global_forward_pre_hooks,
        "module_post": torch_module._global_forward_hooks,
        "optimizer_pre": torch_optimizer._global_optimizer_pre_hooks,
        "optimizer_post": torch_optimizer._global_optimizer_post_hooks,
    }
    return {
        name: sum(1 for h in table.values() if getattr(h, "__module__", "").startswith(PLUGIN))
        for name, table in tables.items()
    }


def saves(model) -> bool:
    """Whether `torch.save` pickles the whole model (transformers 5 puts a local function on the input embeddings
    when it enables checkpointing: no 5.x model saves that way, with or without the plugin)."""
    try:
        torch.save(model, io.BytesIO())
    except (AttributeError, TypeError, pickle.PicklingError):
        return False
    return True


def plugin_free(steps: int = 0):
    """What the same model saves like without the plugin: enabled as the tests enable it, `steps` SGD steps."""
    model = make_model()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sgd_loop(model, steps=steps)
    return model


# --- 1. a bad setting never turns the protection off ---------------------------------------------------------------


def test_a_bad_setting_on_the_loop_route_is_refused_in_strict_not_an_internal_error(monkeypatch, plugin_log):
    """`TRL_GC_PLUGIN=1 TRL_GC_PLUGIN_AUDIT=perhaps` on a plain loop: refused as on the Trainer route (one line naming
    the variable), before any update; never "internal error" and an unchecked run."""
    model = frozen_model()
    with env_route(monkeypatch, TRL_GC_PLUGIN_AUDIT="perhaps"), pytest.raises(GCConfigError, match="AUDIT"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        sgd_loop(model)
    assert "internal error" not in plugin_log.text
    targets = ("transformers.training_args", "transformers.trainer")
    with env_route(monkeypatch, targets, TRL_GC_PLUGIN_AUDIT="perhaps"), pytest.raises(GCConfigError, match="AUDIT"):
        args = TrainingArguments("unused", gradient_checkpointing=True, report_to="none", use_cpu=True)
        Trainer(model=make_model(), args=args, train_dataset=tokenized_dataset(make_tokenizer()))


# --- 2. bad settings on the loop route are said --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"TRL_GC_PLUGIN_MODE": "bogus"}, "TRL_GC_PLUGIN_MODE: got 'bogus'"),
        ({"TRL_GC_PLUGIN_MODE": "fix", "TRL_GC_PLUGIN_AUDIT": "perhaps"}, "TRL_GC_PLUGIN_AUDIT: got 'perhaps'"),
        ({"TRL_GC_PLUGIN_OUTPUT_DIR": "/nonexistent/trl-gc"}, "/nonexistent/trl-gc"),
    ],
)
def test_a_bad_setting_on_the_loop_route_is_said_once(monkeypatch, plugin_log, env, said):
    model = make_model()
    model.train()
    with env_route(monkeypatch, **env):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        sgd_loop(model)
    assert plugin_log.text.count(said) == 1, plugin_log.text


def test_guard_output_dir_that_does_not_exist_is_said(plugin_log, tmp_path):
    missing = tmp_path / "missing"
    model = make_model()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trl_gc_plugin.guard(model, output_dir=str(missing))
    sgd_loop(model)
    assert str(missing) in plugin_log.text and "not an existing directory" in plugin_log.text
    assert not missing.exists()


# --- 3. copies and pickles carry nothing ---------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["env", "install"])
def test_a_copy_made_before_the_first_forward_carries_nothing(monkeypatch, route):
    """An EMA / reference model deep-copied between the enable call and the first forward (TRL's
    `create_reference_model` deep-copies too): no hook of the plugin on it, during training and after, and it saves
    as the plugin-free copy does."""
    scope = env_route(monkeypatch) if route == "env" else trl_gc_plugin.installed(mode="strict")
    model = make_model()
    model.train()
    with scope:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ref = copy.deepcopy(model)
        assert plugin_hooks(ref) == []
        sgd_loop(model)
        assert plugin_hooks(ref) == [] and saves(ref) == saves(copy.deepcopy(plugin_free()))
    assert plugin_hooks(ref) == [] and saves(ref) == saves(copy.deepcopy(plugin_free()))
    assert saves(ref) is not TF5  # 4.57 saves; transformers 5's own input hook is a local function


@pytest.mark.parametrize("route", ["guard", "install"])
def test_the_model_saves_after_a_one_step_loop(route):
    model = make_model()
    model.train()
    scope = trl_gc_plugin.installed(mode="strict") if route == "install" else contextlib.nullcontext()
    with scope:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if route == "guard":
            trl_gc_plugin.guard(model)
        sgd_loop(model, steps=1)
        assert plugin_hooks(model) == [] and saves(model) == saves(plugin_free(steps=1))


# --- 4. nothing leaks when a route never reaches an optimizer step -------------------------------------------------


def test_a_manual_update_without_a_torch_optimizer_leaves_no_hook_and_says_the_checks_never_ran(plugin_log):
    before = global_hooks()
    model = make_model()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trl_gc_plugin.guard(model)
    sgd_loop(model, steps=2, manual=True)
    assert global_hooks() == before
    assert plugin_log.text.count("first-step checks did not run") == 1, plugin_log.text


def test_a_reference_model_used_only_under_no_grad_leaves_no_process_wide_hook(plugin_log):
    """`guard(ref)` on a reference model that only ever runs under `no_grad`, beside a policy trained with `guard()`:
    once the policy's first step is over, nothing of the plugin runs on the forwards of either model."""
    before = global_hooks()
    policy, ref = make_model(), make_model(seed=1)
    for model in (policy, ref):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trl_gc_plugin.guard(policy)
    trl_gc_plugin.guard(ref)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    for step in range(2):
        with torch.no_grad():
            ref(**batch(step))
        policy(**batch(step)).loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            assert global_hooks()["module_pre"] == before["module_pre"]
            assert global_hooks()["module_post"] == before["module_post"]
    assert global_hooks() == before
    del ref
    import gc

    gc.collect()
    assert global_hooks() == before


def test_a_strict_refusal_on_one_of_two_models_leaves_no_hook(plugin_log):
    """A strict refusal on one model (the frozen-inputs failure, transformers 4.x) while another model is guarded:
    after the refusal and the other model's first step, no plugin hook stays registered."""
    before = global_hooks()
    good, bad = make_model(), frozen_model()
    good.train()
    good.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    bad.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    trl_gc_plugin.guard(good)
    refused = None
    try:
        trl_gc_plugin.guard(bad, mode="strict")
        sgd_loop(bad, steps=1)
    except GCConfigError as exc:
        refused = exc
    assert (refused is not None) is (not TF5), "4.57 loses every decoder layer there; 5.x trains them"
    sgd_loop(good, steps=2)
    assert global_hooks() == before


# --- 5. one input, one behaviour -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"use_reentrant": False, "bogus": 1}, "checkpointing-kwargs-unknown"),
        ({"use_reentrant": "yes"}, "invalid-use-reentrant"),
        ({"use_reentrant": 1}, "invalid-use-reentrant"),
    ],
)
@pytest.mark.parametrize("route", ["callback", "install", "guard"])
def test_the_same_checkpointing_kwargs_are_said_on_every_route(route, kwargs, said, plugin_log, tmp_path):
    """What the Trainer route says about the checkpointing kwargs, the model route says too: an unknown key, a
    `use_reentrant` that is not a bool (fix mode: converted, with a warning)."""
    if route == "callback":
        args = TrainingArguments(
            str(tmp_path),
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs=dict(kwargs),
            report_to="none",
            use_cpu=True,
            max_steps=1,
            per_device_train_batch_size=2,
        )
        data = tokenized_dataset(make_tokenizer())
        Trainer(model=make_model(), args=args, train_dataset=data, callbacks=[SafeGCCallback(mode="fix")]).train()
    else:
        model = make_model()
        model.train()
        with trl_gc_plugin.installed(mode="fix") if route == "install" else contextlib.nullcontext():
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs))
            if route == "guard":
                trl_gc_plugin.guard(model, mode="fix")
            sgd_loop(model, steps=1)
    lines = [r for r in plugin_log.records if said in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(lines) == 1, plugin_log.text


# --- 6. a loop that re-enables after the first step ---------------------------------------------------------------


@pytest.mark.parametrize("route", ["guard", "install"])
def test_a_loop_that_reenables_keeps_the_repair(route, plugin_log):
    """Fix mode repairs frozen embeddings + reentrant at the first forward; a loop that calls the enable method again
    every step with `use_reentrant=True` keeps training as without checkpointing (the repair is applied again at each
    re-enable, said once), at no cost to a step that does not re-enable."""
    torch.manual_seed(0)
    reference = frozen_model()
    sgd_loop(reference, steps=3)  # no checkpointing: what every route must train
    model = frozen_model()
    scope = trl_gc_plugin.installed(mode="fix") if route == "install" else contextlib.nullcontext()
    with scope:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        if route == "guard":
            trl_gc_plugin.guard(model, mode="fix")
        sgd_loop(model, steps=3, reenable={"use_reentrant": True})
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    if not TF5:  # 5.x makes the inputs require grad at every enable: nothing to repair there
        assert plugin_log.text.count("re-enabled") == 1, plugin_log.text


# --- 7. settings that are not what they look like ------------------------------------------------------------------


@pytest.mark.parametrize("value", [1.5, "1.5", "2.5B", 0, -3])
def test_a_budget_that_is_not_a_whole_positive_number_of_bytes_is_refused(value):
    with pytest.raises(GCConfigError, match="memory_budget"):
        SafeGCCallback(memory_budget=value)
