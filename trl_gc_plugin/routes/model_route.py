"""The model route: the plugin for loops without a `Trainer` (OpenRLHF, verl, `accelerate`, plain PyTorch), through
the same `Run` as the Trainer route. A `LoopConfig` stands in for `TrainingArguments`, the model's first training
forward, first optimizer step (torch's process-wide pre-hook) and re-enables for the callback's events. Entered by
`guard(model)` or the patched enable methods (`install()`); a model a Trainer `claim`s stays the Trainer route's.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from .._base import report
from .._base.weak import WeakIdMap
from ..core.decisions import Decision
from ..core.errors import contained
from ..core.kwargs import LAYER_KWARGS
from ..core.settings import GCSettings
from ..model import ckpt, probe
from ..model.hooks import Handle
from ..runtime.run import Run

ENABLE_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")  # the second: transformers 5.23+

_MARK = "__trl_gc_plugin_loop__"
_lock = threading.RLock()
_patched: dict[str, Any] = {}  # method name -> the original function
_patched_class: list[Any] = []

_CLAIMED: WeakIdMap[bool] = WeakIdMap()  # models a Trainer route owns (keyed by the unwrapped model)
_ROUTES: WeakIdMap[ModelRoute] = WeakIdMap()
_ENABLED: WeakIdMap[tuple[dict[str, Any] | None]] = WeakIdMap()  # what each model's last enable call was passed
_inside = threading.local()
_MISSING = object()


@dataclass
class LoopConfig:
    """The arguments of a loop without a Trainer, as the rules read them (the fields `TrainingArguments` has).

    `deepspeed` is `{"zero_optimization": {"stage": 3}}` when the parameters are ZeRO-3 partitions (a DeepSpeed config
    transformers still holds comes first); the DDP fields are torch's defaults, which `accelerate` keeps.
    """

    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    output_dir: str | None = None
    deepspeed: dict[str, Any] | None = None
    ddp_find_unused_parameters: bool | None = False
    ddp_static_graph: bool | None = False
    log_level: str = "passive"

    @property
    def world_size(self) -> int:
        dist = _distributed()
        return int(dist.get_world_size()) if dist is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)

    @property
    def process_index(self) -> int:
        if (dist := _distributed()) is not None:
            return int(dist.get_rank())
        return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)

    @property
    def hf_deepspeed_config(self) -> Any:
        """The `HfDeepSpeedConfig` OpenRLHF and accelerate create for ZeRO-3 before loading the model, else None."""
        try:
            from transformers.integrations import deepspeed as hf_deepspeed
        except ImportError:
            return None
        ref = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
        return ref() if ref is not None else None


def _distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


# A loop's checkpointed forward drops the KV cache per layer itself (`GradientCheckpointingLayer`), and the cache
# switch needs the Trainer's step events: `use-cache-off` has nothing to do here.
ROUTE_FACTS: dict[str, Any] = {"use_cache": False}


class ModelRoute:
    """The plugin for one model trained without a Trainer: a `Run` driven by the model's own events. `kwargs`: what
    the loop passed to the enable call; `known=False` when only the model is seen (its checkpoint function's keywords,
    whose author is unknown)."""

    def __init__(self, model: Any, settings: GCSettings, kwargs: dict[str, Any] | None, known: bool) -> None:
        self.model_ref = weakref.ref(model)
        self.kwargs = dict(kwargs) if kwargs is not None else None
        self.known = known
        self.run = Run(settings, cache_switch=False, route_facts=ROUTE_FACTS)
        self.state = "new"  # then `decided`, `first step` (its checks armed), `done` (first step checked), `ended`;
        # `standing back`: the loop checkpoints by its own means, only its first step's gradients are looked at
        self._calls: list[Any] = []
        self._tracked: Tracked | None = None

    def decide(self) -> list[Decision]:
        model = self.model_ref()
        if model is None:
            return []
        kwargs = dict(self.kwargs) if self.kwargs is not None else None
        args = LoopConfig(True, kwargs, self.run.settings.output_dir, _zero3_partitions(model))
        if self.known:
            given = self.kwargs or {}
            probe.start_record(args, "use_reentrant" in given, given.get("use_reentrant"))
        else:  # the keywords the model runs: the loop's or transformers' default, which cannot be told apart
            funcs = ckpt.functions(ckpt.unwrap(model))
            running = ckpt.keywords(funcs[0][1]) if funcs else {}
            args.gradient_checkpointing_kwargs = dict(running) if running else None
            if "use_reentrant" in running:
                self.run.args = args
                self.run.reentrant.hold(running["use_reentrant"], "unknown", args)
        before = dict(args.gradient_checkpointing_kwargs or {})
        self.state = "decided"
        decisions = self.run.decide(args, model)
        _sync_model(model, before, args.gradient_checkpointing_kwargs or {})
        return decisions

    def arm(self) -> None:
        """Wait for the first training forward at the model's and its input embeddings' `__call__` (PEFT < 0.14 calls
        the model's `forward` directly), dispatched at their classes by identity."""
        model = self.model_ref()
        if model is not None:
            base = ckpt.unwrap(model)
            self._calls = [
                self.run.hooks.method(entry, "__call__", self._on_call, lasting=True)
                for entry in (base, probe.embeddings(base))
                if entry is not None
            ]
            ends = weakref.finalize(model, _collected, weakref.ref(self))  # the model collected: the route ends
            self.run.hooks.add(Handle(ends.detach, lasting=True))

    def _on_call(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        with contained("the model route", self._fail):
            self._see_call()
        return original(*args, **kwargs)

    def _see_call(self) -> None:
        import torch

        model = self.model_ref()
        if self.run.stopped:  # refused, or failed: the run removed its hooks itself
            self.state = "ended"
        if self.state in ("done", "ended", "standing back") or model is None:  # nothing more to see here
            for handle in self._calls:
                self.run.hooks.discard(handle)
            self._calls = []
            return
        if not (torch.is_grad_enabled() and ckpt.unwrap(model).training):
            return
        if self.state == "first step":
            if self._tracked is not None and self._tracked.changed():  # updated, yet no optimizer step seen
                self.end("the model's parameters changed without a torch optimizer step (an update by hand?)")
            return
        if not probe.checkpointing_on(model):  # turned off again before training: nothing to guard
            if self._stand_back(model):  # the loop's own checkpointing: its first step is still checked
                self.state = "standing back"
                self.run.hooks.optimizer_step(self._on_own_step)
            else:
                self.end()
            return
        if not any(p.requires_grad for p in model.parameters()):  # a frozen (reference) model: no step will come
            self.end("it has no trainable parameter (a frozen reference model?)")
            return
        if self.state == "new":
            self.decide()
        facts = self.run.begin(self.run.args, model, asked=True)
        self.run.arm_first_step(facts, model)
        self.run.hooks.optimizer_step(self._on_step)
        head = getattr(ckpt.unwrap(model), "get_output_embeddings", lambda: None)()
        if head is not None:  # a training forward no backward can reach ends the route there (`_see_output`)
            self.run.hooks.forward(head, self._see_output)
        self._tracked = Tracked.of(model)
        self.state = "first step"

    def _stand_back(self, model: Any) -> bool:
        """Say once that the loop checkpoints by its own means, where checkpointing was turned off again and the loop
        replaced the forward of checkpointable blocks (verl's activation offloader wraps each FSDP unit in its own
        reentrant `torch.utils.checkpoint`); a plain turn-off stays silent. True when it stands back."""
        blocks = ckpt.blocks(ckpt.unwrap(model))
        replaced = sum(1 for block in blocks if "forward" in vars(block))
        if replaced:
            report.note(
                f"{type(ckpt.unwrap(model)).__name__}: checkpointing was enabled, then turned off again before "
                f"training, and the loop replaced the forward of {replaced} of its {len(blocks)} blocks (as verl's "
                "activation offloader does to checkpoint each unit itself): the plugin stands back; it guards "
                "transformers' checkpointing only, not the loop's own.",
                "info",
                main_process=report.is_main_process(),
            )
        return bool(replaced)

    def _on_own_step(self, optimizer: Any) -> None:
        """At the first step of a loop that checkpoints by its own means: say which trainable block tensors got no
        gradient (a reentrant wrapper whose inputs do not require grad: frozen input embeddings without
        `enable_input_require_grads()` train nothing inside the blocks, silently), then end."""
        model = self.model_ref()
        if self.state != "standing back" or model is None or not _steps(optimizer, model):
            return
        with contained("the model route", self._fail):
            base = ckpt.unwrap(model)
            params = [p for block in ckpt.blocks(base) for p in block.parameters() if p.requires_grad]
            missing = sum(1 for p in params if p.grad is None)
            if missing:
                report.note(
                    f"{type(base).__name__}: at the first optimizer step {missing} of the {len(params)} trainable "
                    "tensors in its blocks have no gradient under the loop's own checkpointing: a reentrant "
                    "checkpoint whose inputs do not require grad (frozen input embeddings) trains nothing inside it; "
                    "call model.enable_input_require_grads() before training, or checkpoint with use_reentrant=False.",
                    "warning",
                    main_process=report.is_main_process(),
                )
            self.end()

    def _see_output(self, module: Any, args: Any, output: Any) -> None:
        """The output embeddings' result in a training forward of the first step: when it does not require grad, no
        backward reaches the model's parameters (its backward fails, or nothing trains them): no step will check."""
        import torch

        with contained("the model route", self._fail):
            if self.state != "first step" or not (torch.is_grad_enabled() and module.training):
                return
            if isinstance(output, torch.Tensor) and not output.requires_grad:
                self.end(
                    "its training forward returned logits that do not require grad, so no backward reaches its "
                    "trainable parameters (frozen or cut off by reentrant checkpointing; the backward fails)"
                )

    def _on_step(self, optimizer: Any) -> None:
        model = self.model_ref()
        if self.state != "first step" or self.run.stopped or model is None or not _steps(optimizer, model):
            return
        with contained("the model route", self._fail):
            self.run.before_optimizer_step(model)
            self.run.step_end(asked=True)
            self.state, self._tracked = "done", None
            self.run.hooks.remove(keep_lasting=True)  # the enable guard stays; `__call__` goes at the next forward

    def end(self, why: str | None = None) -> None:
        """Take the route off the model, keeping its repairs; `why` the first step's checks did not run."""
        if why and self.state in ("new", "decided", "first step") and self.run.settings.audit:
            model = self.model_ref()
            name = type(ckpt.unwrap(model)).__name__ if model is not None else "a collected model"
            report.note(f"{name}: the first-step checks did not run: {why}.", "info")
        self.state, self._tracked = "ended", None
        self._calls = []
        self.run.stop(keep_repairs=True)

    def _fail(self, exc: Exception) -> None:
        self.state = "ended"
        self._calls = []
        self.run.fail(exc, "the model route")


def _collected(route: weakref.ref[ModelRoute]) -> None:
    current = route()
    if current is not None and current.state != "ended":
        current.end()


def _sync_model(model: Any, before: dict[str, Any], after: dict[str, Any]) -> None:
    """What the decisions changed in the loop's kwargs, onto the model's checkpoint function (the loop enabled once,
    before the plugin decided)."""
    for key in sorted((set(before) | set(after)) - set(LAYER_KWARGS)):  # transformers applied those at the enable call
        if before.get(key, _MISSING) != after.get(key, _MISSING):
            ckpt.set_keyword(model, key, after.get(key))


def _steps(optimizer: Any, model: Any) -> bool:
    """Whether `optimizer` steps `model`: it holds one of its trainable parameters, or (over copies: DeepSpeed's
    partitions) some of them hold a gradient now."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = {id(p) for p in trainable}
    groups = getattr(optimizer, "param_groups", None) or []
    held = any(id(p) in ids for group in groups for p in group.get("params", ()))
    return held or any(p.grad is not None for p in trainable)


class Tracked:
    """The smallest trainable parameter, its version counter and a copy of its values at the first training forward:
    an update changes them, with or without an optimizer (`p.data.add_` bumps no version counter)."""

    def __init__(self, param: Any) -> None:
        self.ref = weakref.ref(param)
        self.version = param._version
        self.values = param.detach().clone()

    @classmethod
    def of(cls, model: Any) -> Tracked | None:
        """None under ZeRO-3 (partitions) or without a trainable parameter."""
        trainable = [p for p in model.parameters() if p.requires_grad and p.numel() > 0]
        if not trainable or any(hasattr(p, "ds_id") for p in trainable[:1]):
            return None
        return cls(min(trainable, key=lambda p: p.numel()))

    def changed(self) -> bool:
        import torch

        param = self.ref()
        if param is None:
            return False
        return param._version != self.version or not torch.equal(param.detach(), self.values)


def _zero3_partitions(model: Any) -> dict[str, Any] | None:
    # zero.Init partitions every parameter: the first tells
    first = next(iter(model.parameters()), None)
    return {"zero_optimization": {"stage": 3}} if first is not None and hasattr(first, "ds_id") else None


def guard(
    model: Any,
    mode: str | None = None,
    *,
    audit: bool | None = None,
    parity_check: bool | None = None,
    memory_budget: str | int | None = None,
    output_dir: str | None = None,
) -> list[Decision]:
    """Make checkpointing safe for `model` in a loop without a `Trainer`: decide now (strict refuses, fix repairs, warn
    reports) and check the first training step. Call it after `model.gradient_checkpointing_enable(...)`, before the
    first training forward (under `install()` / `TRL_GC_PLUGIN=1` the enable call does it). `mode`, `audit`,
    `parity_check`, `memory_budget` as `SafeGCCallback`'s; `output_dir`: where `gc_decisions.json` goes (default
    `TRL_GC_PLUGIN_OUTPUT_DIR`, else no file). Returns the decisions; `GCConfigError` in strict mode for a setup
    known to break training (before any update).
    """
    settings = GCSettings.resolve(
        dict(mode=mode, audit=audit, parity_check=parity_check, memory_budget=memory_budget, output_dir=output_dir),
        caller="guard",
    )
    report.setup()
    base = ckpt.unwrap(model)
    old = _ROUTES.pop(base)
    if old is not None:
        old.end()
    if not probe.checkpointing_on(base):
        report.note(
            "guard(): the model does not checkpoint; call model.gradient_checkpointing_enable(...) first.", "warning"
        )
        return []
    enabled = _ENABLED.get(base)
    route = ModelRoute(model, settings, enabled[0] if enabled else None, enabled is not None)
    _ROUTES.set(base, route)
    decisions = route.decide()
    route.arm()
    return decisions


def claim(model: Any) -> None:
    """A Trainer route owns `model` from now on: its model route goes, and later enable calls arm none."""
    base = ckpt.unwrap(model)
    _CLAIMED.set(base, True)
    route = _ROUTES.pop(base)
    if route is not None:
        route.end()


def _loop_kwargs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The enable call's arguments as the Trainer's checkpointing kwargs, with `every_n_layers` / `offload`."""
    given = kwargs.get(f"{name.split('_', 1)[0]}_checkpointing_kwargs", args[0] if args else None)
    out = dict(given) if isinstance(given, dict) else None
    layer = {k: kwargs[k] for k in LAYER_KWARGS if k in kwargs} | dict(zip(LAYER_KWARGS, args[1:3], strict=False))
    layer = {k: v for k, v in layer.items() if (v != 1 if k == "every_n_layers" else v)}  # not the defaults
    return {**(out or {}), **layer} if layer else out


def _wrap(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def enable(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = not getattr(_inside, "active", False)
        _inside.active = True
        try:
            result = original(self, *args, **kwargs)
        finally:
            if outer:
                _inside.active = False
        if outer:
            with contained("the model route"):  # a strict refusal of a setting stops here, the enable call raises it
                _after_enable(self, _loop_kwargs(name, args, kwargs))
        return result

    setattr(enable, _MARK, True)
    enable.original = original  # type: ignore[attr-defined]
    return enable


def _after_enable(model: Any, kwargs: dict[str, Any] | None) -> None:
    base = ckpt.unwrap(model)
    if _CLAIMED.get(base):  # a Trainer's model (TRL's trainers re-enable every step): nothing to record
        return
    _ENABLED.set(base, (kwargs,))
    if not _patched:
        return
    old = _ROUTES.get(base)
    if old is not None and old.state in ("first step", "done"):
        return  # the route runs: its enable guard sees this re-enable
    settings = GCSettings.resolve({}, caller="TRL_GC_PLUGIN")  # before anything is armed: a refusal raises here
    if old is not None:
        old.end()
    route = ModelRoute(model, settings, kwargs, True)
    _ROUTES.set(base, route)
    route.arm()


def patch_enable(cls: Any = None) -> None:
    """Patch `PreTrainedModel`'s enable methods (idempotent). Undo with `unpatch_enable()`."""
    if cls is None:
        from transformers import PreTrainedModel as cls
    with _lock:
        _patched_class[:] = [cls]
        for name in ENABLE_METHODS:
            current = cls.__dict__.get(name)
            if current is None or getattr(current, _MARK, False):
                continue
            _patched[name] = current
            setattr(cls, name, _wrap(name, current))


def unpatch_enable() -> None:
    """Restore the enable methods exactly, and stop every armed route."""
    if not _patched:
        return
    with _lock:
        (PreTrainedModel,) = _patched_class
        for name, original in list(_patched.items()):
            if getattr(PreTrainedModel.__dict__.get(name), _MARK, False):
                setattr(PreTrainedModel, name, original)
            else:
                report.note(f"PreTrainedModel.{name} was re-patched by someone else; left as it is.", "warning")
        _patched.clear()
    end_all("uninstall() was called")


def end_all(when: str) -> None:
    """Every model route ends, saying so for those whose first step had not come."""
    for route in list(_ROUTES.values()):
        waited_for = "a training forward" if route.state in ("new", "decided") else "an optimizer step of the model"
        route.end(f"{when} before {waited_for}")


atexit.register(end_all, "the process ended")
