"""The architecture zoo: no false refusals and no missed silent failures, on every architecture.

For every (architecture, variant, use_reentrant): a no-checkpointing reference, the same run without the plugin, and
with it (strict). The plugin run must train every trainable parameter the reference trains; it may stop - before
any parameter update - only where the run without the plugin trains fewer or crashes. Where strict refuses, fix mode
must train what the reference trains.

`ZOO=slice` (set by `make matrix` on the transformers 4.57 environment; the 5.23 one runs every architecture) runs a
representative slice: one architecture of each kind, and both MoE routers (Mixtral's and Qwen3-MoE's).
"""

from __future__ import annotations

import os

import pytest
from zoo import BY_NAME, ZOO
from zoo_run import REENTRANT, VARIANTS, Outcome, run, run_loop

SLICE = ("llama", "gpt2", "bart", "llava", "mamba", "qwen3_moe", "mixtral")
ARCHS = [a.name for a in ZOO if os.environ.get("ZOO", "full") != "slice" or a.name in SLICE]

_references: dict[tuple[str, str], Outcome] = {}


def reference(arch: str, variant: str) -> Outcome:
    key = (arch, variant)
    if key not in _references:
        _references[key] = run(arch, variant, gc=False)
        assert _references[key].error is None, _references[key].error
        assert _references[key].changed, "the reference trains nothing: the setup is broken"
    return _references[key]


def refused_only_with_evidence(ref: Outcome, setup) -> Outcome | None:
    """The two guarantees, for `setup(mode)` (mode None: without the plugin): a refusal (before any update) only where
    the run without the plugin loses parameters or crashes, then fix mode trains everything; else the plugin's run
    trains everything the reference trains. Returns the plugin's outcome when it was not refused. The run without
    the plugin is the evidence a refusal needs: it runs only for one."""
    plugin = setup("strict")
    if plugin.refused:
        bare = setup(None)
        assert plugin.changed_at_error == frozenset(), "refused after parameters were updated"
        assert bare.error is not None or not ref.changed <= bare.changed, (
            f"false refusal: the run without the plugin trains everything ({plugin.error})")
        fixed = setup("fix")
        assert fixed.error is None, fixed.error
        assert ref.changed <= fixed.changed, f"fix mode left untrained: {sorted(ref.changed - fixed.changed)[:4]}"
        return None
    assert plugin.error is None, plugin.error
    missed = sorted(ref.changed - plugin.changed)
    assert not missed, f"{len(missed)} parameters the reference trains did not train: {missed[:4]}"
    return plugin


def assert_replayed_state_named(arch: str, plugin: Outcome) -> None:
    """State the checkpointed forward writes is named once, as a warning, on the architecture that writes it (a
    counter in its blocks), and on no other."""
    found = [d for d in plugin.decisions if d.rule_id == "forward-state-replayed"]
    if not BY_NAME[arch].writes_state:
        assert not found, found
        return
    assert len(found) == 1 and found[0].action == "warn", found
    assert found[0].after and all(name.endswith("tokens_seen") for name in found[0].after)


@pytest.mark.parametrize("use_reentrant", REENTRANT, ids=lambda v: f"reentrant={v}")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_zoo(arch, variant, use_reentrant):
    ref = reference(arch, variant)
    plugin = refused_only_with_evidence(ref, lambda mode: run(arch, variant, use_reentrant, plugin=mode))
    if plugin is None:
        return
    # nothing the audit calls checkpointing's fault on a run that trains everything
    assert not [d for d in plugin.decisions if d.rule_id == "gradient-audit" and d.action == "error"]
    assert_replayed_state_named(arch, plugin)
    if use_reentrant != "unset" and not [d for d in plugin.decisions if d.action in ("override", "repair")
                                         and d.setting == "use_reentrant"]:
        assert plugin.running is use_reentrant, "a value the user set was changed without a decision saying so"


LOOP_VARIANTS = ("frozen_emb", "lora")
_loop_references: dict[tuple[str, str], Outcome] = {}


@pytest.mark.parametrize("use_reentrant", ["unset", True], ids=lambda v: f"reentrant={v}")
@pytest.mark.parametrize("variant", LOOP_VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_without_a_trainer(arch, variant, use_reentrant):
    """The model route (a plain loop's own enable call under `TRL_GC_PLUGIN=1`): the same two guarantees on every
    architecture - it refuses (before any update) only where the loop without the plugin loses parameters or crashes,
    and otherwise trains everything the no-checkpointing loop trains."""
    key = (arch, variant)
    if key not in _loop_references:
        _loop_references[key] = run_loop(arch, variant, gc=False)
        assert _loop_references[key].error is None and _loop_references[key].changed
    plugin = refused_only_with_evidence(
        _loop_references[key], lambda mode: run_loop(arch, variant, use_reentrant, plugin=mode)
    )
    if plugin is not None:
        assert_replayed_state_named(arch, plugin)
