"""torch.compile (issue 26, item 6): the plugin must not change what compile sees. Its first-step forward hooks
broke the compiled graph (5 graph breaks, 5 graphs where the plugin-free run has 0 and 1); under compile they stand
aside (rule `torch-compile-first-step`) and the run compiles (no more graph breaks or graphs than without the plugin)
and trains exactly as without it."""

from __future__ import annotations

import pytest
import torch
from trainers import make_trainer
from transformers import TrainingArguments

from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.model import probe
from trl_gc_plugin.testing import make_model

dynamo = pytest.importorskip("torch._dynamo")


def compiled_run(tmp_path, use_reentrant, callbacks):
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    model = make_model()
    trainer = make_trainer("trainer", model, str(tmp_path), gc_kwargs={"use_reentrant": use_reentrant},
                           callbacks=callbacks, max_steps=2, torch_compile=True, torch_compile_backend="aot_eager")
    trainer.train()
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    return model, breaks, graphs


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_the_compiled_graph_and_the_training_are_those_without_the_plugin(use_reentrant, tmp_path):
    bare, bare_breaks, bare_graphs = compiled_run(tmp_path / "bare", use_reentrant, None)
    callback = SafeGCCallback(memory_budget="1TiB")
    plugged, breaks, graphs = compiled_run(tmp_path / "plugin", use_reentrant, [callback])
    # never more; fewer on transformers 4.57 (the plugin switches use_cache off for the steps, so the forward does
    # not log its use_cache warning, itself a graph break)
    assert breaks <= bare_breaks and graphs <= bare_graphs, (breaks, graphs, bare_breaks, bare_graphs)
    expected = dict(bare.named_parameters())
    assert all(torch.equal(p, expected[n]) for n, p in plugged.named_parameters())
    rules = {d.rule_id: d for d in callback.decisions}
    assert "torch_compile=True" in rules["torch-compile-first-step"].reason
    assert rules["memory-plan"].reason.startswith("No memory plan: torch_compile=True")
    assert "gradient-audit" in rules  # the audit still reads the first step's gradients
    assert not callback.observed


def test_a_model_compiled_before_the_trainer_is_seen(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    model = make_model()
    assert probe.compiled(args, model) is None
    assert probe.compiled(args, torch.compile(model, backend="eager")) == "the model is wrapped by torch.compile"
    model.compile(backend="eager")
    assert probe.compiled(args, model) == "the model was compiled in place (Module.compile)"


@pytest.mark.parametrize("text", [
    "model_name_or_path: m\ndataset_name: d\ntorch_compile: true\n",  # TRL CLI
    "base_model: m\ngradient_checkpointing: true\ntorch_compile: true\n",  # Axolotl
])
def test_the_check_says_what_the_run_says_of_torch_compile(tmp_path, text):
    """`trl-gc-check` on a config with `torch_compile: true` (checkpointing on) gives the decision the run records at
    train begin."""
    from trl_gc_plugin.configcheck.check import Launch, check_files

    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    (report,) = check_files([str(path)], Launch(parser="model"))
    assert [(d.action, d.level) for d in report.decisions if d.rule_id == "torch-compile-first-step"] == [("none", "info")]
    path.write_text(text.replace("torch_compile: true", "torch_compile: false"))
    (report,) = check_files([str(path)], Launch(parser="model"))
    assert not [d for d in report.decisions if d.rule_id == "torch-compile-first-step"]
