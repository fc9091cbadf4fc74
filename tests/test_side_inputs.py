"""Side inputs set by hooks are gone in the recompute (issue 26, item 3; the PEFT aLoRA pattern, peft #2826): a
model-level pre-hook stores per-batch state that adapters inside the layers read, a forward hook clears it, and the
checkpointed layers recompute after it is cleared. Without the plugin no adapter trains, silently, for both
`use_reentrant` values. With the plugin (defaults, strict) the gradient audit sees blocks whose gradients are all
zero or missing, starts the parity probe, and the run stops before any parameter update."""

from __future__ import annotations

import pytest
import torch
from trainers import make_trainer

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.testing import make_model


class SideInputAdapter(torch.nn.Module):
    """A low-rank adapter applied where a per-batch mask (set by a hook on the whole model) says; no mask: zeros,
    so the recompute runs the same operations (no CheckpointError) and the adapter's gradient is zero."""

    def __init__(self, base: torch.nn.Linear, state: dict) -> None:
        super().__init__()
        self.base, self.state = base, state
        self.a = torch.nn.Parameter(torch.randn(base.in_features, 2) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(2, base.out_features) * 0.1)

    def forward(self, x):
        mask = self.state.get("mask")
        if mask is None:
            mask = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
        return self.base(x) + (x @ self.a @ self.b) * mask[..., None]


def build():
    torch.manual_seed(0)
    model = make_model()
    state: dict = {}
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = SideInputAdapter(layer.self_attn.q_proj, state)
        layer.self_attn.v_proj = SideInputAdapter(layer.self_attn.v_proj, state)

    def set_mask(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        state["mask"] = (ids > 3).to(torch.float32)

    def clear_mask(module, args, output):
        state["mask"] = None

    model.register_forward_pre_hook(set_mask, with_kwargs=True)
    model.register_forward_hook(clear_mask)
    model.enable_input_require_grads()  # as PEFT does: the frozen-inputs failure is not the one shown here
    return model


def trained(model, before) -> int:
    return sum(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if p.requires_grad)


def run(tmp_path, use_reentrant, callbacks=None):
    model = build()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    gc_kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    trainer = make_trainer("trainer", model, str(tmp_path), gc=use_reentrant is not None, gc_kwargs=gc_kwargs,
                           callbacks=callbacks, max_steps=2)
    try:
        trainer.train()
    except GCConfigError as exc:
        return trained(model, before), len(before), exc
    return trained(model, before), len(before), None


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_without_the_plugin_no_adapter_trains_silently(use_reentrant, tmp_path):
    done, total, _ = run(tmp_path / "ref", None)
    assert done == total == 8  # without checkpointing every adapter tensor trains
    done, total, error = run(tmp_path / "bare", use_reentrant)
    assert (done, error) == (0, None)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_with_the_plugin_strict_stops_before_any_update(use_reentrant, tmp_path):
    callback = SafeGCCallback()
    done, _, error = run(tmp_path, use_reentrant, [callback])
    assert error is not None and done == 0
    assert "[parity-check]" in str(error) and "only without checkpointing" in str(error)
    audit = [d.reason for d in callback.decisions if d.rule_id == "gradient-audit"]
    assert any("parity probe below" in reason for reason in audit), audit


def test_warn_mode_reports_and_goes_on(tmp_path):
    callback = SafeGCCallback(mode="warn")
    done, _, error = run(tmp_path, False, [callback])
    assert error is None and done == 0
    (parity,) = [d for d in callback.decisions if d.rule_id == "parity-check"]
    assert parity.action == "warn"
