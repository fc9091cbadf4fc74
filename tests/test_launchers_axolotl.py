"""The Axolotl plugin (`trl_gc_plugin.integrations.axolotl.SafeGCPlugin`) with a real Axolotl.

Axolotl is not in the project's environments (its releases pin their own transformers/TRL): these tests are skipped
there and run in their own virtual environment, `make test-launchers` (Axolotl 0.19.0, transformers 5.16.1, TRL 1.9.0,
torch 2.13.0 CPU). `axolotl train` runs for real on a tiny local model: offline, on CPU, two steps.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "trl_gc_plugin.integrations.axolotl.SafeGCPlugin"
needs_axolotl = pytest.mark.skipif(importlib.util.find_spec("axolotl") is None, reason="axolotl is not installed")


def test_import_trl_gc_plugin_never_loads_the_integrations():
    code = (
        "import sys, trl_gc_plugin, trl_gc_plugin.integrations\n"
        "print(sorted(m for m in sys.modules if m.startswith(('axolotl', 'trl_gc_plugin.integrations.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# --- loading and validation, in process -----------------------------------------------------------------------------


@pytest.fixture
def manager():
    from axolotl.integrations.base import PluginManager

    pm = PluginManager.get_instance()
    before = dict(pm.plugins)
    yield pm
    pm.plugins.clear()
    pm.plugins.update(before)


@needs_axolotl
def test_plugin_manager_loads_the_plugin_from_its_dotted_path(manager):
    from axolotl.integrations.base import BasePlugin
    from axolotl.integrations.config import merge_input_args

    from trl_gc_plugin.configcheck.launchers.axolotl import PLUGIN as CHECKED
    from trl_gc_plugin.integrations.axolotl import PLUGIN_LINE

    assert PLUGIN == PLUGIN_LINE == CHECKED  # the line trl-gc-check asks for is the one Axolotl loads
    manager.register(PLUGIN)
    plugin = manager.plugins[PLUGIN]
    assert isinstance(plugin, BasePlugin) and type(plugin).__name__ == "SafeGCPlugin"
    assert manager.get_input_args() == ["trl_gc_plugin.integrations.axolotl.SafeGCArgs"]
    _, config_class = merge_input_args()  # Axolotl's schema with the plugin's keys
    assert {"trl_gc_mode", "trl_gc_memory_budget", "trl_gc_audit"} <= set(config_class.model_fields)


@needs_axolotl
def test_a_bad_mode_is_refused_in_one_line():
    from pydantic import ValidationError

    from trl_gc_plugin.integrations.axolotl import SafeGCArgs

    with pytest.raises(ValidationError) as raised:
        SafeGCArgs(trl_gc_mode="bogus")
    assert "axolotl(mode=...): got 'bogus'; mode accepts strict, fix or warn (any case)" in str(raised.value)


@needs_axolotl
def test_keys_are_resolved_by_the_settings_layer():
    from pydantic import ValidationError

    from trl_gc_plugin.integrations.axolotl import SafeGCArgs

    with pytest.raises(ValidationError, match=r"refused its settings \(mode=strict\): axolotl\(audit=...\): got"):
        SafeGCArgs(trl_gc_audit="perhaps")
    args = SafeGCArgs(trl_gc_mode="WARN", trl_gc_audit="perhaps", trl_gc_memory_budget="1GiB")
    assert (args.trl_gc_mode, args.trl_gc_audit, args.trl_gc_memory_budget) == ("warn", True, 1 << 30)


@needs_axolotl
def test_a_failed_import_stops_the_run_instead_of_being_logged(manager, monkeypatch):
    """PluginManager.register catches ImportError (logs it, trains on without the plugin); the plugin raises
    RuntimeError instead, which reaches the user."""
    monkeypatch.delitem(sys.modules, "trl_gc_plugin.integrations.axolotl", raising=False)
    monkeypatch.setitem(sys.modules, "axolotl.integrations.base", None)  # any import of the module fails
    with pytest.raises(RuntimeError, match="Axolotl plugin could not be loaded"):
        importlib.import_module("trl_gc_plugin.integrations.axolotl")
    monkeypatch.delitem(sys.modules, "trl_gc_plugin.integrations.axolotl", raising=False)


@needs_axolotl
@pytest.mark.parametrize("offloading", [None, "true"])
def test_activation_offloading_is_not_checkpointing_unasked(tmp_path, offloading):
    """With `activation_offloading: true|legacy|disk` Axolotl passes gradient_checkpointing=False and checkpoints the
    model itself (an adapter keeps the load-time checkpointing). `axolotl train` cannot run that on CPU (TRL's
    OffloadActivations asks torch.accelerator for a device), so the callback is given the same situation: a model
    that checkpoints, arguments that say off."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from trl_gc_plugin.integrations.axolotl import AxolotlSafeGCCallback
    from trl_gc_plugin.testing import lm_dataset, make_model, make_tokenizer

    model = make_model()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True
    )
    callback = AxolotlSafeGCCallback((False, None), offloading, parity_check=False)
    tokenizer = make_tokenizer()
    data = lm_dataset(4).map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    Trainer(model=model, args=args, train_dataset=data, data_collator=collator, callbacks=[callback]).train()
    ids = {d.rule_id for d in callback.decisions}
    assert ("checkpointing-unasked" in ids) is (offloading is None)


# --- `axolotl train`, for real ----------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("TRL_GC_PLUGIN", "TRL_GC_PLUGIN_MODE", "LOG_LEVEL", "AXOLOTL_LOG_LEVEL"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny local Llama (the project's test model) and a 16-row completion dataset."""
    from trl_gc_plugin.testing import make_model, make_tokenizer

    root = tmp_path_factory.mktemp("axolotl")
    make_model().save_pretrained(root / "model")
    make_tokenizer().save_pretrained(root / "model")
    with open(root / "data.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog {i}"}) + "\n")
    return root


def _config(tiny: Path, out: Path, extra: str = "", plugin: str | None = PLUGIN) -> Path:
    plugins = f"plugins:\n  - {plugin}\n" if plugin else ""
    text = f"""base_model: {tiny / "model"}
{plugins}datasets:
  - path: {tiny / "data.jsonl"}
    ds_type: json
    type: completion
dataset_prepared_path: {tiny / "prepared"}
output_dir: {out}
sequence_len: 64
micro_batch_size: 2
gradient_accumulation_steps: 1
max_steps: 2
learning_rate: 0.0001
optimizer: adamw_torch
lr_scheduler: constant
gradient_checkpointing: true
bf16: false
fp16: false
tf32: false
save_strategy: "no"
val_set_size: 0
{extra}"""
    path = out.parent / f"{out.name}.yml"
    path.write_text(text)
    return path


def _train(cfg: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["axolotl", "train", str(cfg)], capture_output=True, text=True, env={**_env(), **env}, cwd=cfg.parent,
        timeout=600,
    )


def _check(cfg: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "trl_gc_plugin", "check", "--json", str(cfg)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    (report,) = json.loads(out.stdout)
    return report


def _final_use_reentrant(start, decisions):
    value = start
    for d in decisions:
        if d["setting"] == "use_reentrant" and d["action"] in ("default", "override", "repair"):
            value = d["after"]
    return value


SUMMARY = re.compile(r"\[trl_gc_plugin\] INFO: gradient checkpointing on, use_reentrant=(\w+) \(([^)]*\)?)\)")


@needs_axolotl
@pytest.mark.parametrize("route", ["plugins-line", "env-var"])
@pytest.mark.parametrize(
    ("extra", "source"),
    [("", "set by launcher (axolotl)"), ("gradient_checkpointing_kwargs:\n  use_reentrant: false\n", "yours")],
    ids=["axolotl-writes-it", "yaml-sets-it"],
)
def test_axolotl_train_runs_the_plugin(tiny, tmp_path, extra, source, route):
    """Through the `plugins:` line, or `TRL_GC_PLUGIN=1` on an unmodified config (the plugin installed in Axolotl's
    environment: its `.pth` starts the route): the summary visible at Axolotl's default log levels, and the
    `use_reentrant` Axolotl wrote itself said to be Axolotl's (before, the env-var route hid the summary and called
    Axolotl's value the user's)."""
    out = tmp_path / "out"
    cfg = _config(tiny, out, extra, plugin=PLUGIN if route == "plugins-line" else None)
    run = _train(cfg, **({"TRL_GC_PLUGIN": "1"} if route == "env-var" else {}))
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    found = SUMMARY.search(log)  # visible under Axolotl's logging filter, default levels
    assert found, log[-4000:]
    running, who = found.group(1), found.group(2)
    assert who == source
    decisions = json.loads((out / "gc_decisions.json").read_text())
    assert any(d["rule_id"] == "gradient-audit" and d["action"] == "none" for d in decisions)

    report = _check(cfg)  # trl-gc-check on the same file: the same use_reentrant
    checked = _final_use_reentrant(report["facts"]["use_reentrant"], report["decisions"])
    assert repr(checked) == running


@needs_axolotl
def test_axolotl_train_refuses_a_bad_mode_before_loading_anything(tiny, tmp_path):
    run = _train(_config(tiny, tmp_path / "out", "trl_gc_mode: bogus\n"))
    assert run.returncode != 0
    assert "axolotl(mode=...): got 'bogus'; mode accepts strict, fix or warn (any case)" in run.stdout + run.stderr
