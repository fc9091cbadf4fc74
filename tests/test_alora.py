"""Rule `alora-needs-input-grads` (issue 26, item 3, the real PEFT aLoRA): PEFT hands aLoRA's offsets to the
recompute through hooks that a full backward hook on each checkpointed layer removes; when no input of the layer
requires grad that hook fires before the recompute, which then applies the adapter to no token. Reproduced here on
transformers 4.x (the enable call and the Trainer add no input hook for a PEFT model): non-reentrant stops with
`CheckpointError` at the first backward, reentrant with the frozen-inputs `RuntimeError`. The plugin adds
transformers' input hook (as transformers 5 does) and the gradients are those of no checkpointing; a Trainer run takes
the hook off at train end, a loop keeps it."""

from __future__ import annotations

import pytest
import torch

import trl_gc_plugin
from trl_gc_plugin import SafeGCCallback
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

peft = pytest.importorskip("peft")
pytest.importorskip("peft.tuners.lora.variants")

from trainers import TF5, make_trainer  # noqa: E402

RULE = "alora-needs-input-grads"
STEPS = 3


def alora_model(invocation: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False,
                        alora_invocation_tokens=[invocation], task_type="CAUSAL_LM")
    return get_peft_model(make_model(), config)


def invocation_token() -> int:
    """The third token of the Trainer dataset's first sequence: the adapter acts from there on in the sequences that
    hold it (the test checks that the adapters train at all)."""
    return tokenized_dataset(make_tokenizer())["input_ids"][0][2]


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def trainer_run(tmp_path, use_reentrant, gc=True, mode=None):
    """One Trainer run of STEPS steps: (the adapters after it or the exception, the callback)."""
    token = invocation_token()
    model = alora_model(token)
    callback = SafeGCCallback(mode=mode) if mode else None
    kwargs = None if use_reentrant == "unset" else {"use_reentrant": use_reentrant}
    trainer = make_trainer("trainer", model, str(tmp_path), gc=gc, gc_kwargs=kwargs, max_steps=STEPS,
                           callbacks=[callback] if callback else None)
    try:
        trainer.train()
    except Exception as exc:  # the failure reproduced
        return exc, callback, model
    return adapters(model), callback, model


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[n], b[n], rtol=1e-4, atol=1e-6) for n in a)


@pytest.mark.parametrize("use_reentrant", ["unset", False, True], ids=lambda v: f"reentrant={v}")
def test_alora_under_the_trainer(tmp_path, use_reentrant):
    reference, _, _ = trainer_run(tmp_path / "ref", use_reentrant, gc=False)
    assert isinstance(reference, dict)
    start = adapters(alora_model(invocation_token()))
    assert not close(reference, start), "the adapters did not train: the invocation token is not in the batch"

    bare, _, _ = trainer_run(tmp_path / "bare", use_reentrant)
    if TF5:  # transformers 5 adds the input hook itself: nothing to repair
        assert isinstance(bare, dict) and close(bare, reference)
    elif use_reentrant in (True, "unset"):  # 4.x: unset means reentrant
        assert isinstance(bare, RuntimeError) and "does not require grad" in str(bare)
    else:
        assert type(bare).__name__ == "CheckpointError" and "different metadata" in str(bare)

    for mode in ("strict", "fix"):
        plugged, callback, model = trainer_run(tmp_path / mode, use_reentrant, mode=mode)
        assert isinstance(plugged, dict), plugged
        assert close(plugged, reference), "the adapters differ from the run without checkpointing"
        found = [d for d in callback.decisions if d.rule_id == RULE]
        assert [d.action for d in found] == ([] if TF5 else ["repair"])
        if not TF5:  # a value the user set is kept: the repair makes it work
            assert not [d for d in callback.decisions if d.action in ("error", "override") and d.setting == "use_reentrant"]
        if not TF5:  # the hook the plugin added is gone, handle and all (on 5.x it is transformers' own)
            base = trl_gc_plugin.model.ckpt.unwrap(model)
            assert "_require_grads_hook" not in base.__dict__ and not base.get_input_embeddings()._forward_hooks


def loop_run(use_reentrant, mode=None, gc=True):
    model = alora_model(7)
    model.train()
    if mode:
        trl_gc_plugin.install(mode=mode)
    try:
        if gc:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            ids = torch.randint(8, 64, (2, 12), generator=gen)
            ids[:, 4] = 7  # the invocation token
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as exc:
        return exc, model
    finally:
        if mode:
            trl_gc_plugin.uninstall()
    return adapters(model), model


@pytest.mark.skipif(TF5, reason="transformers 5 adds the input hook itself")
@pytest.mark.parametrize("use_reentrant", [False, True], ids=lambda v: f"reentrant={v}")
def test_alora_in_a_loop(use_reentrant):
    reference, _ = loop_run(use_reentrant, gc=False)
    bare, _ = loop_run(use_reentrant)
    assert not isinstance(bare, dict)
    assert (type(bare).__name__ == "CheckpointError") is (use_reentrant is False)
    plugged, model = loop_run(use_reentrant, mode="strict")
    assert isinstance(plugged, dict) and close(plugged, reference)
    # the loop goes on after the route's first step: the repair stays, as transformers 5 would have it
    assert hasattr(trl_gc_plugin.model.ckpt.unwrap(model), "_require_grads_hook")


def test_no_alora_no_rule():
    from peft import LoraConfig, get_peft_model

    from trl_gc_plugin.model import probe

    plain = get_peft_model(make_model(), LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert probe.uses_alora(plain) is False and probe.uses_alora(alora_model(7)) is True
