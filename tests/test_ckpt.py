"""`ckpt`: the one owner of checkpointing on a model, on real tiny models with checkpointing enabled."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from trl_gc_plugin.core.layout import Layout
from trl_gc_plugin.model import ckpt
from trl_gc_plugin.model.hooks import Hooks
from trl_gc_plugin.model.observe import Observation, _Observer
from trl_gc_plugin.model.policies import lean_context, selective_context
from trl_gc_plugin.testing import make_model

LAYERS = 4


def _model(**kwargs: object) -> torch.nn.Module:
    model = make_model(num_hidden_layers=LAYERS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, **kwargs})
    model.train()
    return model


def test_readers() -> None:
    model = _model()
    blocks = ckpt.blocks(model)
    assert len(blocks) == LAYERS
    assert {id(m) for m, _ in ckpt.functions(model)} >= {id(b) for b in blocks}
    func = ckpt.function_of(blocks[0])
    assert isinstance(func, functools.partial) and func.func is checkpoint
    assert ckpt.keywords(func)["use_reentrant"] is False
    assert ckpt.use_reentrant(func) is False
    assert ckpt.use_reentrant(functools.partial(checkpoint)) is True  # torch's default
    assert ckpt.model_use_reentrant(model) is False
    model.gradient_checkpointing_disable()
    assert ckpt.model_use_reentrant(model) is None


def test_with_keywords_keeps_other_keywords() -> None:
    func = ckpt.function_of(ckpt.blocks(_model(preserve_rng_state=False))[0])
    new = ckpt.with_keywords(func, use_reentrant=True, determinism_check="none")
    assert new.func is func.func
    assert new.keywords == {"use_reentrant": True, "preserve_rng_state": False, "determinism_check": "none"}
    assert ckpt.with_keywords(new, determinism_check=None).keywords == {
        "use_reentrant": True,
        "preserve_rng_state": False,
    }
    assert func.keywords == {"use_reentrant": False, "preserve_rng_state": False}  # the original is untouched
    assert ckpt.with_keywords(checkpoint, use_reentrant=False).keywords == {"use_reentrant": False}


def test_set_keyword_counts_changes() -> None:
    model = _model()
    changed = ckpt.set_keyword(model, "use_reentrant", True)
    assert changed == len(ckpt.functions(model)) >= LAYERS
    assert ckpt.model_use_reentrant(model) is True
    assert ckpt.set_keyword(model, "use_reentrant", True) == 0  # already so
    assert ckpt.set_keyword(model, "preserve_rng_state", None) == 0  # no such key: nothing to remove


def test_apply_sets_the_layout_and_keywords_on_every_block() -> None:
    model = _model(preserve_rng_state=False)
    layout = Layout(("selective", "none", "lean", "none"))
    ckpt.apply(model, ckpt.Spec(layout=layout, use_reentrant=False, keywords={"determinism_check": "none"}))
    blocks = ckpt.blocks(model)
    assert tuple(b.gradient_checkpointing for b in blocks) == layout.pattern and ckpt.layout_of(model) == layout
    for block, kind in zip(blocks, layout.kinds, strict=True):  # blocks switched off keep (and get) the function too
        keywords = ckpt.keywords(ckpt.function_of(block))
        assert keywords["determinism_check"] == "none"
        assert keywords["preserve_rng_state"] is False  # kept
        assert keywords.get("context_fn") is {"selective": selective_context, "lean": lean_context}.get(kind)
    ckpt.apply(model, ckpt.Spec(layout=Layout.from_pattern(layout.pattern, "offload")))
    for block in blocks:
        func = ckpt.function_of(block)
        assert "context_fn" not in func.keywords
    assert ckpt.layout_of(model).kinds == ("offload", "none", "offload", "none")
    ckpt.apply(model, ckpt.Spec(layout=Layout.from_pattern(layout.pattern, "full"), keywords={"determinism_check": None}))
    for block in blocks:
        func = ckpt.function_of(block)
        assert func.func is checkpoint and "determinism_check" not in func.keywords
    ckpt.apply(model, ckpt.Spec(use_reentrant=True))
    assert tuple(b.gradient_checkpointing for b in blocks) == layout.pattern  # no layout: flags untouched


def test_apply_refuses_what_cannot_run() -> None:
    model = _model()
    with pytest.raises(ValueError, match="selective"):
        ckpt.apply(model, ckpt.Spec(use_reentrant=True, layout=Layout.uniform("selective", LAYERS)))
    with pytest.raises(ValueError, match="blocks"):
        ckpt.apply(model, ckpt.Spec(layout=Layout(("full",))))


def test_spec_is_frozen() -> None:
    spec = ckpt.Spec(keywords={"offload": None})
    with pytest.raises(AttributeError):
        spec.use_reentrant = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.keywords["x"] = 1  # type: ignore[index]


def test_real_unwraps_an_installed_observer() -> None:
    model = _model()
    block = ckpt.blocks(model)[0]
    func = ckpt.function_of(block)
    observation = Observation(model, Hooks(), lambda call: "report")
    observation.install()
    seen = []

    def peek(module: object, args: object) -> None:
        seen.append(ckpt.function_of(block))

    handle = block.register_forward_pre_hook(peek)
    try:
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    finally:
        handle.remove()
        observation.remove()
    assert isinstance(seen[0], _Observer) and ckpt.real(seen[0]) is func
    assert ckpt.use_reentrant(seen[0]) is False
    assert ckpt.function_of(block) is func  # put back after the forward
    assert ckpt.real(func) is func


def test_apply_writes_behind_the_observer() -> None:
    model = _model()
    block = ckpt.blocks(model)[0]
    observer = _Observer(None, block, ckpt.function_of(block))  # type: ignore[arg-type]
    ckpt.set_function(block, observer)
    ckpt.apply(model, ckpt.Spec(use_reentrant=True))
    assert ckpt.function_of(block) is observer  # it stays in front
    assert ckpt.keywords(observer)["use_reentrant"] is True
    ckpt.set_keyword(model, "use_reentrant", False)
    assert ckpt.function_of(block) is not observer  # set_keyword replaces it


def test_snapshot_restore_round_trips() -> None:
    model = _model(preserve_rng_state=False)
    before = [(ckpt.function_of(b), b.gradient_checkpointing) for b in ckpt.blocks(model)]
    before_stack = model.model.__dict__.get(ckpt.FLAG)
    saved = ckpt.snapshot(model)
    ckpt.apply(model, ckpt.Spec(layout=Layout.uniform("none", LAYERS), use_reentrant=True))
    model.model.gradient_checkpointing = False  # someone else writes a flag
    ckpt.restore(saved)
    assert [(ckpt.function_of(b), b.gradient_checkpointing) for b in ckpt.blocks(model)] == before
    assert model.model.__dict__.get(ckpt.FLAG) == before_stack


def test_restore_keeping_use_reentrant() -> None:
    """The enable guard's restore: the recorded wrapper and keywords, with the use_reentrant running now."""
    model = _model()
    ckpt.apply(model, ckpt.Spec(layout=Layout(('full', 'none') * (LAYERS // 2)), keywords={"determinism_check": "none"}))
    saved = ckpt.snapshot(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})  # a re-enable
    ckpt.restore(saved, keep_use_reentrant=True)
    blocks = ckpt.blocks(model)
    assert tuple(b.gradient_checkpointing for b in blocks) == (True, False) * (LAYERS // 2)
    for block in blocks:
        assert ckpt.keywords(ckpt.function_of(block)) == {"use_reentrant": True, "determinism_check": "none"}


def test_snapshot_narrowed() -> None:
    model = _model()
    blocks = ckpt.blocks(model)
    flags_only = ckpt.snapshot(model, functions=False)
    first_only = ckpt.snapshot(model, flags=False, only=[blocks[0]])
    assert flags_only.functions == () and first_only.flags == ()
    assert [ref() for ref, _ in first_only.functions] == [blocks[0]]
    ckpt.set_keyword(model, "use_reentrant", True)
    ckpt.set_flag(blocks[1], False)
    ckpt.restore(flags_only)
    assert blocks[1].gradient_checkpointing is True
    assert ckpt.model_use_reentrant(model) is True  # functions left alone
    ckpt.restore(first_only)
    assert ckpt.use_reentrant(ckpt.function_of(blocks[0])) is False
    assert ckpt.use_reentrant(ckpt.function_of(blocks[1])) is True


@pytest.mark.parametrize("kind", ["selective", "lean"])
def test_the_plugins_selective_blocks_inside_saved_tensor_hooks_warn_nothing_and_keep_their_result(kind) -> None:
    """torch 2.14+ warns (FutureWarning: a saved_tensors_hooks context is active around a selective checkpoint region)
    when `respect_saved_tensors_hooks` is left unset, and has announced that the unset setting becomes an error, then
    flips. The plugin's own selective blocks say `False` (today's behaviour) where the installed torch has the key:
    no warning, the gradients of full checkpointing."""
    import warnings

    from trl_gc_plugin.core.capabilities import torch_checkpoint_keywords

    model = _model()
    ids = torch.randint(3, 64, (2, 8))

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full = grads()
    ckpt.apply(model, ckpt.Spec(layout=Layout.uniform(kind, LAYERS)))
    keywords = ckpt.keywords(ckpt.function_of(ckpt.blocks(model)[0]))
    assert keywords.get("respect_saved_tensors_hooks", "absent") == (
        False if "respect_saved_tensors_hooks" in torch_checkpoint_keywords() else "absent"
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = grads()
    assert not [w for w in seen if "saved_tensors_hooks" in str(w.message)], [str(w.message) for w in seen]
    assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True))
