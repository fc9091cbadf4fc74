"""Run one zoo setup through a real `Trainer`: which trainable parameters changed, or what was raised.

    python tests/zoo_run.py [ARCH ...]      # the sweep as a table (all architectures without arguments)

A setup is (architecture, variant, use_reentrant, plugin). Variants: `full` (every parameter trains), `frozen_emb`
(the input embeddings are frozen), `lora` (a PEFT LoRA adapter on the attention projections, vision towers
included), `lora_hooked` (the same plus `enable_input_require_grads()`, as PEFT's and TRL's own preparation does: on
transformers 4.x it hooks only the top-level input embeddings, not a vision or audio tower's). `plugin` is None (no
plugin) or a mode; `gc=False` gives the no-checkpointing reference.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))

from zoo import BATCH, BY_NAME, ZOO, Arch

VARIANTS = ("full", "frozen_emb", "lora", "lora_hooked")
REENTRANT = ("unset", True, False)
STEPS = 2


@dataclasses.dataclass
class Outcome:
    """`changed`: trainable parameters whose value changed; `error`: `Type: first line` of what was raised;
    `changed_at_error`: parameters that had changed when it was raised (must be empty for a refusal)."""

    changed: frozenset[str] = frozenset()
    trainable: int = 0
    error: str | None = None
    changed_at_error: frozenset[str] = frozenset()
    decisions: list[Any] = dataclasses.field(default_factory=list)
    running: bool | None = None

    @property
    def refused(self) -> bool:
        return bool(self.error and self.error.startswith("GCConfigError"))

    def settle(self, params: dict[str, Any], before: dict[str, Any], model: Any, exc: BaseException | None = None) -> None:
        """Record what changed (and what was raised, if anything) once the run is over."""
        from trl_gc_plugin.model.ckpt import model_use_reentrant

        changed = frozenset(n for n, p in params.items() if not torch.equal(p.detach(), before[n]))
        if exc is None:
            self.changed, self.running = changed, model_use_reentrant(model)
            return
        self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        self.changed_at_error = changed


class _Steps(torch.utils.data.Dataset):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __len__(self) -> int:
        return self.steps * BATCH

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"i": i}


def build(arch: Arch, variant: str) -> Any:
    model = arch.build()
    if variant == "frozen_emb":
        model.get_input_embeddings().weight.requires_grad_(False)
    elif variant in ("lora", "lora_hooked"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=list(arch.lora), lora_dropout=0.0,
                                                 task_type=arch.task))
        if variant == "lora_hooked":
            model.enable_input_require_grads()
    elif variant != "full":
        raise ValueError(variant)
    return model


def run(arch: Arch | str, variant: str, use_reentrant: Any = "unset", plugin: str | None = None, gc: bool = True,
        model: Any = None, extra_callbacks: list[Any] | None = None, steps: int = STEPS,
        **callback_kwargs: Any) -> Outcome:
    from transformers import Trainer, TrainingArguments

    from trl_gc_plugin import SafeGCCallback

    arch = BY_NAME[arch] if isinstance(arch, str) else arch
    model = build(arch, variant) if model is None else model
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    batches = [arch.batch(step) for step in range(steps)]
    counter = iter(range(10**6))

    def collate(_items: list[dict[str, int]]) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in batches[next(counter) % steps].items()}

    kwargs = None if use_reentrant == "unset" else {"use_reentrant": use_reentrant}
    callbacks = ([SafeGCCallback(mode=plugin, **callback_kwargs)] if plugin else []) + list(extra_callbacks or [])
    callback = next((c for c in callbacks if isinstance(c, SafeGCCallback)), None)
    outcome = Outcome(trainable=len(params))
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-2, report_to="none",
            use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
            remove_unused_columns=False, gradient_checkpointing=gc, gradient_checkpointing_kwargs=kwargs,
        )
        try:
            trainer = Trainer(model=model, args=args, train_dataset=_Steps(steps), data_collator=collate,
                              callbacks=callbacks or None)
            trainer.train()
        except Exception as exc:  # the outcome is the exception; the test decides whether it is expected
            outcome.settle(params, before, model, exc)
        else:
            outcome.settle(params, before, model)
        if callback is not None:
            outcome.decisions = list(callback.decisions)
    return outcome


def run_loop(arch: Arch | str, variant: str, use_reentrant: Any = "unset", plugin: str | None = None, gc: bool = True,
             steps: int = STEPS) -> Outcome:
    """The same setup in a plain PyTorch loop without a Trainer (SGD), the model route of `TRL_GC_PLUGIN=1`:
    `installed(plugin)` around the loop's own `gradient_checkpointing_enable` call and its steps."""
    import contextlib

    from trl_gc_plugin import installed
    from trl_gc_plugin.model import ckpt
    from trl_gc_plugin.routes import model_route as loop

    arch = BY_NAME[arch] if isinstance(arch, str) else arch
    torch.manual_seed(0)
    model = build(arch, variant)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in params.items()}
    outcome = Outcome(trainable=len(params))
    scope = installed(plugin) if plugin else contextlib.nullcontext()
    with scope, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model.train()
            if gc:
                kwargs = None if use_reentrant == "unset" else {"use_reentrant": use_reentrant}
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            optimizer = torch.optim.SGD(list(params.values()), lr=1e-2)
            for step in range(steps):
                model(**arch.batch(step)).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        except Exception as exc:  # the outcome is the exception; the test decides whether it is expected
            outcome.settle(params, before, model, exc)
        else:
            outcome.settle(params, before, model)
        route = loop._ROUTES.get(ckpt.unwrap(model))
        if route is not None and route.state != "new":
            outcome.decisions = list(route.run.decisions)
    return outcome


def _show(o: Outcome, ref: Outcome) -> str:
    return o.error[:90] if o.error else f"{len(o.changed & ref.changed)}/{len(ref.changed)}"


def sweep(names: list[str]) -> None:
    """Print, per setup: the reference's trained count, then the bare run's and the plugin's outcomes."""
    for name in names:
        arch = BY_NAME[name]
        for variant in VARIANTS:
            ref = run(arch, variant, gc=False)
            for reentrant in REENTRANT:
                bare = run(arch, variant, reentrant)
                plug = run(arch, variant, reentrant, plugin="strict")
                verdict = ""
                if plug.refused and not bare.error and ref.changed <= bare.changed:
                    verdict = "FALSE REFUSAL"
                elif not plug.error and not ref.changed <= plug.changed:
                    verdict = "MISSED"
                print(f"{name:14} {variant:10} {reentrant!s:5}  bare {_show(bare, ref):20} plugin "
                      f"{_show(plug, ref):40} {verdict}", flush=True)


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    sweep(sys.argv[1:] or [a.name for a in ZOO])
