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


def _gradients(model, batch, checkpointing: bool) -> dict[str, torch.Tensor]:
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_replayed_state_the_output_reads_is_refused_in_strict_on_the_parity_probes_evidence(arch):
    # Without the plugin: the recompute reads the count its forward already advanced, so the gradients differ from
    # training without checkpointing (the same initial weights and counts).
    batch = BY_NAME[arch].batch(0)
    grads = {}
    for checkpointing in (False, True):
        model = build(BY_NAME[arch], "full")
        count_in_blocks(model, "buffer", reads=True)
        grads[checkpointing] = _gradients(model, batch, checkpointing)
    worst = max(float((grads[True][k] - grads[False][k]).abs().max() / grads[False][k].abs().max().clamp_min(1e-12))
                for k in grads[False])
    assert worst > 1e-3, worst
    for reentrant in (True, False):
        # strict: refused at the first optimizer step, before any update, naming the state and the evidence
        model = build(BY_NAME[arch], "full")
        count_in_blocks(model, "buffer", reads=True)
        outcome = run(arch, "full", reentrant, plugin="strict", model=model)
        assert outcome.refused and not outcome.changed_at_error
        refusal = [d for d in outcome.decisions if d.action == "error"]
        assert [d.rule_id for d in refusal] == ["forward-state-replayed"] and "tokens_seen" in refusal[0].reason
        # fix and warn: said, with the evidence, and the run goes on (nothing the plugin can switch repairs it)
        for mode in ("fix", "warn"):
            model = build(BY_NAME[arch], "full")
            count_in_blocks(model, "buffer", reads=True)
            outcome = run(arch, "full", reentrant, plugin=mode, model=model)
            assert outcome.error is None
            found = [d for d in outcome.decisions if d.rule_id == "forward-state-replayed"]
            assert [d.action for d in found] == ["warn", "warn"] and "changes the gradients" in found[1].reason
