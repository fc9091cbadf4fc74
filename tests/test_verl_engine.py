"""verl's FSDP engine under the plugin (issue 44), emulated with the real transformers, PEFT and torch FSDP2 on 2 CPU
ranks (tests/verl_scenarios.py): verl's enable call (non-reentrant), LoRA after `enable_input_require_grads()`,
`fully_shard`, `use_cache=False` steps, on a tiny Llama and (transformers 5.x) a tiny Qwen3-MoE whose router trains
from its load-balancing loss. Under `TRL_GC_PLUGIN=1` nothing is refused and the weights, the router's included, are
those of the run without the plugin. Where verl's activation offloader owns checkpointing (`gradient_checkpointing_disable()`,
then its own reentrant checkpoint per layer) the plugin stands back and says so once; where that wrapper trains
nothing inside the blocks (frozen input embeddings, transformers 4.x: 2 of 20 tensors train, silently, reproduced
below without the plugin) it says that at the first step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from trainers import TF5
from verl_scenarios import own_reentrant_checkpoint

from trl_gc_plugin import installed
from trl_gc_plugin.testing import make_model

# The tiny Qwen3-MoE on FSDP2 runs on transformers 5.x only: on 4.57.6 (one module per expert) its first step aborts a
# rank without the plugin too (gloo: "Received data size doesn't match expected size. Is there a distributed
# collective mismatch", measured here), the ranks routing to other experts; that is FSDP2's and not the plugin's.
SCENARIOS = ["full-engine", "lora-engine", *(["moe-engine"] if TF5 else []), "full-offload", "lora-offload"]
STANDS_BACK = "the plugin stands back"


def test_verls_engine_on_fsdp2_trains_as_without_the_plugin(tmp_path):
    from torchrun import run_scenarios

    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off = run_scenarios("verl_scenarios.py", tmp_path / "off", SCENARIOS, env={"TRL_GC_PLUGIN": "0"})
    on = run_scenarios("verl_scenarios.py", tmp_path / "on", SCENARIOS, env={"TRL_GC_PLUGIN": "1"})
    for scenario in SCENARIOS:
        for rank in (0, 1):
            without, with_plugin = off[scenario][rank], on[scenario][rank]
            assert not without["plugin"] and with_plugin["plugin"]
            assert without["outcome"] == with_plugin["outcome"] == "trained", (scenario, rank, with_plugin)
            assert with_plugin["changed"] == with_plugin["trainable"] == without["changed"]
            assert with_plugin["checksum"] == without["checksum"]  # the same weights, bit for bit
        said = [line for line in on[scenario][0]["log"] if STANDS_BACK in line]
        assert len(said) == (1 if scenario.endswith("offload") else 0), on[scenario][0]["log"]
        assert not any(STANDS_BACK in line for line in on[scenario][1]["log"])  # the main process says it
        if scenario.endswith("engine"):  # the route decided for verl's kwargs
            assert any("use_reentrant=False (yours)" in line for line in on[scenario][0]["log"])


def offloader_loop(frozen_embeddings: bool, plugin: bool) -> tuple[int, int]:
    """verl's offloader path on one process: enable, disable, its own reentrant checkpoint per layer, two steps;
    (trainable tensors changed, trainable tensors)."""
    model = make_model()
    if frozen_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with installed("strict") if plugin else contextlib.nullcontext():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for module in model.modules():
            if hasattr(module, "gradient_checkpointing_disable"):
                module.gradient_checkpointing_disable()
        for layer in model.model.layers:
            own_reentrant_checkpoint(layer)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model.train()
        for step in range(2):
            ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()
    changed = sum(1 for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n]))
    return changed, len(before)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_the_offloaders_own_reentrant_checkpoint_with_frozen_embeddings(plugin_log):
    """Without the plugin, transformers 4.57: the decoder layers do not train (2 of 20 tensors change), silently;
    5.x makes the hidden states require grad itself. With the plugin: it stands back, and says what did not train."""
    without = offloader_loop(frozen_embeddings=True, plugin=False)
    assert without == ((20, 20) if TF5 else (2, 20))
    assert "trl_gc_plugin" not in plugin_log.text
    with_plugin = offloader_loop(frozen_embeddings=True, plugin=True)
    assert with_plugin == without  # it changes nothing of the loop's own checkpointing
    text = plugin_log.text
    assert text.count(STANDS_BACK) == 1
    if TF5:
        assert "have no gradient" not in text
    else:
        assert "18 of the 18 trainable tensors in its blocks have no gradient" in text
        assert "enable_input_require_grads()" in text


def test_the_offloader_path_with_trainable_embeddings_is_left_alone(plugin_log):
    assert offloader_loop(frozen_embeddings=False, plugin=True) == (21, 21)
    assert plugin_log.text.count(STANDS_BACK) == 1 and "have no gradient" not in plugin_log.text
