"""Rule `forward-state-replayed`: state a checkpointed forward writes (a counter, MoE tokens-per-expert, a running
statistic) is written again by the recompute in the backward. Reproduced without the plugin on several
architectures; the plugin names what was replayed, changes nothing and never stops the run."""

from __future__ import annotations

import pytest
import torch
from zoo import BY_NAME, count_in_blocks
from zoo_run import build, run

from trl_gc_plugin.runtime.replay import changed, read_state

ARCHS = ("llama", "gpt2", "qwen3_moe", "bart")


def counts(blocks) -> list[int]:
    return [int(b.tokens_seen) for b in blocks]


@pytest.mark.parametrize("how", ["buffer", "attribute"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_recomputed_counter_counts_twice_without_the_plugin_and_the_plugin_names_it(arch, how):
    reference = build(BY_NAME[arch], "full")
    ref_blocks = count_in_blocks(reference, how)
    assert run(arch, "full", gc=False, model=reference).error is None
    expected = counts(ref_blocks)
    assert all(expected)

    for reentrant in (True, False):
        bare = build(BY_NAME[arch], "full")
        bare_blocks = count_in_blocks(bare, how)
        assert run(arch, "full", reentrant, model=bare).error is None
        assert counts(bare_blocks) == [2 * n for n in expected]  # the failure: every batch counted twice, silently

        plugged = build(BY_NAME[arch], "full")
        plugged_blocks = count_in_blocks(plugged, how)
        outcome = run(arch, "full", reentrant, plugin="strict", model=plugged)
        assert outcome.error is None  # a warning: the run goes on
        assert counts(plugged_blocks) == [2 * n for n in expected]  # the plugin changes nothing
        found = [d for d in outcome.decisions if d.rule_id == "forward-state-replayed"]
        assert len(found) == 1 and found[0].action == "warn", [d.rule_id for d in outcome.decisions]
        assert all(name.endswith("tokens_seen") for name in found[0].after)
        assert len(found[0].after) == len(plugged_blocks)


@pytest.mark.parametrize("arch", ARCHS)
def test_no_finding_without_state_in_the_blocks(arch):
    outcome = run(arch, "full", False, plugin="strict")
    assert outcome.error is None
    assert not [d for d in outcome.decisions if d.rule_id == "forward-state-replayed"]


def test_a_buffer_rewritten_with_the_same_values_is_not_a_change():
    before = {"a.cache": (1, 3.0), "a.steps": 1, "b.stats": (4, 2.0)}
    after = {"a.cache": (2, 3.0), "a.steps": 1, "b.stats": (5, 2.5)}
    assert changed(before, after) == ["b.stats"]


def test_the_state_read_holds_no_tensor():
    model = build(BY_NAME["llama"], "full")
    count_in_blocks(model, "buffer")
    model.gradient_checkpointing_enable()
    state = read_state(model)
    assert state and all(not isinstance(v, torch.Tensor) and not any(isinstance(x, torch.Tensor) for x in
                                                                      (v if isinstance(v, tuple) else (v,)))
                         for v in state.values())
