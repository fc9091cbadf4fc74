"""OpenRLHF's own code path on CPU with the model route (issue 27): its `Actor` wrapper loads a tiny local model, its
own `gradient_checkpointing_enable` call (`{"use_reentrant": <flag>}`, as `cli/train_sft.py` makes it), its forward
(`return_logprobs`) and `SFTLoss`, one AdamW step. Skipped unless OpenRLHF is importable: it needs its own environment
(OpenRLHF 0.11.2 pins transformers 5.15.0 and DeepSpeed 0.19.6, and imports flash-attn at module level for sample
packing and ring attention, which does not build without CUDA: `make test-launchers` installs OpenRLHF without its
dependencies and puts a stand-in `flash_attn` on the path whose functions raise; a run without packing never calls
them). Marked `launchers`.

The scenario that fails without the plugin: a Gemma 4 model with cross-layer KV sharing and
`--model.gradient_checkpointing_reentrant`: reentrant checkpointing gives the layers that produce the shared K/V
wrong gradients, silently (the recompute runs without grad). Strict mode refuses it at the first forward, before any
update; fix mode switches to non-reentrant, and the gradients match those without checkpointing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("openrlhf") is None:
    pytest.skip("OpenRLHF is not installed", allow_module_level=True)
if importlib.util.find_spec("flash_attn") is None:  # the stand-in, in OpenRLHF's environment only
    sys.path.append(str(Path(__file__).with_name("stubs")))
pytest.importorskip("openrlhf")
pytestmark = pytest.mark.launchers

import torch  # noqa: E402
import transformers  # noqa: E402

import trl_gc_plugin  # noqa: E402
from trl_gc_plugin import GCConfigError  # noqa: E402


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    config = transformers.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_kv_shared_layers=2, pad_token_id=0, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    path = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(path)
    return str(path)


def sft_step(path: str, reentrant: bool | None, lora_rank: int = 0):
    """One SFT step through OpenRLHF's Actor and SFTLoss; returns (the gradients of the first step, the error)."""
    from openrlhf.models import Actor
    from openrlhf.models.loss import SFTLoss

    actor = Actor(path, attn_implementation="eager", param_dtype="bf16", lora_rank=lora_rank, lora_alpha=8,
                  target_modules=["q_proj", "v_proj"])
    if reentrant is not None:  # OpenRLHF's own call (cli/train_sft.py)
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    actor.train()
    opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    grads, error = {}, None
    try:
        logps = actor(ids, action_mask=mask[:, 1:].bool(), attention_mask=mask, return_logprobs=True)
        loss = SFTLoss()(logps, mask[:, 1:].float() if logps.shape[1] == ids.shape[1] - 1 else mask.float())
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in actor.named_parameters() if p.grad is not None}
        opt.step()
    except GCConfigError as exc:
        error = exc
    return grads, error


def worst(grads, reference):
    """The largest relative difference of a parameter's gradient from the reference's (float32)."""
    if not grads:
        return float("inf")
    out = 0.0
    for name, ref in reference.items():
        got, ref = grads[name].float(), ref.float()
        out = max(out, ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item())
    return out


def test_kv_sharing_with_openrlhfs_reentrant_flag(gemma4_dir):
    reference, _ = sft_step(gemma4_dir, None)
    plain, error = sft_step(gemma4_dir, True)
    assert error is None and worst(plain, reference) > 1e-3  # silently wrong without the plugin
    with trl_gc_plugin.installed(mode="strict"):
        refused, error = sft_step(gemma4_dir, True)
    assert isinstance(error, GCConfigError) and not refused
    with trl_gc_plugin.installed(mode="fix"):
        fixed, error = sft_step(gemma4_dir, True)
    assert error is None and worst(fixed, reference) < 1e-4


def test_lora_through_the_actor_trains_and_is_left_alone(gemma4_dir, plugin_log):
    with trl_gc_plugin.installed(mode="strict"):
        grads, error = sft_step(gemma4_dir, False, lora_rank=4)
    assert error is None and any("lora_" in n for n in grads)
    assert "gradient checkpointing on, use_reentrant=False (yours)" in plugin_log.text
