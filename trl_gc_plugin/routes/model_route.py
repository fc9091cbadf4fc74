"""The model route: the plugin for training loops without a `Trainer` (OpenRLHF, verl, `accelerate` and plain PyTorch
loops), through the same `runtime.run.Run` the Trainer route drives.

Such a loop turns checkpointing on with `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`
(`activation_checkpointing_enable` on transformers >= 5.23) and has no `TrainingArguments` and no callback events.
The route stands in for both:

- the arguments are a `LoopConfig` holding what the loop passed to the enable call (its `use_reentrant` is the
  user's, as a value written in `TrainingArguments` is), and the launch facts the process shows (the world size of
  `torch.distributed` or the launcher's environment, a DeepSpeed config transformers holds for ZeRO-3, accelerate's
  environment);
- the events are the model's first training forward (seen at the model's class, `hooks.Hooks.method`: decide, refuse
  or repair, install the first step's checks: a refusal comes before any backward), its first optimizer step (torch's
  process-wide optimizer pre-hook: the gradient audit and the parity probe before any parameter update; then the first
  step's checks go) and its re-enables (the enable guard: what drifted is put back, said once).

Two ways in: `guard(model, ...)` after the enable call (settings resolved and decided at once, the decisions
returned), and, under `install()` / `TRL_GC_PLUGIN=1`, the patched enable methods of `PreTrainedModel` (settings
resolved at the enable call, which raises a strict refusal; decided at the first training forward). A model a Trainer
manages (`claim`, called by `SafeGCCallback`) is the Trainer route's: the model route stays silent for it.

One lifecycle, every exit path: the run's hooks (`Run.hooks`) go when its first step is over (the enable guard stays
with the model, dispatched by identity, and leaves with it or with `uninstall()`), on a refusal, when the model is
updated without a torch optimizer step (said once: the first-step checks did not run), on `uninstall()`, and at the
end of the process (said once for a route whose first training step never came). While it waits, a route holds the
model weakly and nothing of it runs on other models' forwards.
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
from ..core.settings import GCSettings
from ..model import ckpt, probe
from ..model.hooks import Handle
from ..runtime.run import Run

ENABLE_METHODS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")
"""The `PreTrainedModel` methods a loop turns checkpointing on with (the second exists from transformers 5.23)."""

_MARK = "__trl_gc_plugin_loop__"
_lock = threading.RLock()
_patched: dict[str, Any] = {}
"""Method name -> the original function, while the enable methods are patched."""
_patched_class: list[Any] = []

_CLAIMED: WeakIdMap[bool] = WeakIdMap()
"""Models a Trainer route owns (keyed by the transformers model under any wrapper)."""
_ROUTES: WeakIdMap[ModelRoute] = WeakIdMap()
"""The route of each model (armed, in its first step, or done)."""
_inside = threading.local()


@dataclass
class LoopConfig:
    """The arguments of a loop without a Trainer, as the rules read them (the fields `TrainingArguments` has).

    Args:
        gradient_checkpointing: checkpointing asked for (set True by the route: the loop called the enable method).
        gradient_checkpointing_kwargs: what the loop passed, with `every_n_layers` / `offload` when it passed them
            as arguments; None when it passed nothing.
        output_dir: where `gc_decisions.json` goes (`guard(output_dir=...)`, else `TRL_GC_PLUGIN_OUTPUT_DIR`); None
            writes no file.
        deepspeed: `{"zero_optimization": {"stage": 3}}` when the model's parameters are ZeRO-3 partitions (loaded
            under `deepspeed.zero.Init`, as OpenRLHF and accelerate load for ZeRO-3), else None; a DeepSpeed config
            transformers still holds (`hf_deepspeed_config`) comes first.
        ddp_find_unused_parameters / ddp_static_graph: torch DDP's defaults (False), which `accelerate` keeps unless
            the loop passes `DistributedDataParallelKwargs`.
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
        dist = _distributed()
        if dist is not None:
            return int(dist.get_rank())
        return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)

    @property
    def hf_deepspeed_config(self) -> Any:
        """The DeepSpeed config transformers holds (`HfDeepSpeedConfig`, which OpenRLHF and accelerate create for
        ZeRO-3 before loading the model), else None."""
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


ROUTE_FACTS: dict[str, Any] = {"use_cache": False}
"""What the route knows better than the probe: a loop's checkpointed training forward drops the KV cache per layer
itself (transformers' `GradientCheckpointingLayer`, with a warning), and the plugin's cache switch needs the
Trainer's step events, so the `use-cache-off` rule has nothing to do here."""


class ModelRoute:
    """The plugin for one model trained without a Trainer: a `Run` driven by the model's own events.

    Args:
        model: the transformers model (or a wrapper of it) whose checkpointing the loop enabled.
        settings (`GCSettings`): the settings, resolved before the route was armed.
        kwargs: what the loop passed to the enable call (None: nothing), or None with `known=False` when the route
            only sees the model (its checkpoint function's keywords: their author is unknown, so a value there is
            treated as set explicitly).
    """

    def __init__(self, model: Any, settings: GCSettings, kwargs: dict[str, Any] | None, known: bool) -> None:
        self.model_ref = weakref.ref(model)
        self.kwargs = dict(kwargs) if kwargs is not None else None
        self.known = known
        self.run = Run(settings, cache_switch=False, route_facts=ROUTE_FACTS)
        self.state = "new"
        """`new`, `decided`, `first step` (its checks armed), `done` (its first step checked) or `ended`."""
        self._calls: list[Any] = []
        self._step: Any = None
        self._tracked: tuple[weakref.ref[Any], int] | None = None

    @property
    def waiting(self) -> bool:
        """Its first step's checks have not run yet (and will not, if it ends now)."""
        return self.state in ("new", "decided", "first step")

    # --- the run's stages, from the model's events --------------------------------------------------------------

    def decide(self) -> list[Decision]:
        """Decide for the model and what the loop asked (refuse before anything runs, or apply). Returns the
        decisions."""
        model = self.model_ref()
        if model is None:
            return []
        args = LoopConfig(output_dir=self.run.settings.output_dir, deepspeed=_zero3_partitions(model))
        args.gradient_checkpointing = True
        args.gradient_checkpointing_kwargs = dict(self.kwargs) if self.kwargs is not None else None
        if self.known:
            given = self.kwargs or {}
            probe.start_record(args, "use_reentrant" in given, given.get("use_reentrant"))
        else:  # the keywords the model runs: the loop's or transformers' default, which cannot be told apart
            funcs = ckpt.functions(ckpt.unwrap(model))
            running = ckpt.keywords(funcs[0][1]) if funcs else {}
            args.gradient_checkpointing_kwargs = dict(running) if running else None
            if "use_reentrant" in running:
                probe.remember(args, running["use_reentrant"], "unknown")
        before = dict(args.gradient_checkpointing_kwargs or {})
        self.state = "decided"
        decisions = self.run.decide(args, model)
        _sync_model(model, before, args.gradient_checkpointing_kwargs or {})
        return decisions

    def arm(self) -> None:
        """Wait for the model's first training forward at the model's and its input embeddings' `__call__` (a wrapper
        may call the model's `forward` directly, as PEFT < 0.14's tuners do; the embeddings run in every forward that
        gets token ids), at their classes: by identity, so neither another model nor a copy of this one is hooked,
        and the route holds the model weakly until then."""
        model = self.model_ref()
        if model is not None:
            base = ckpt.unwrap(model)
            entries = [base, probe.embeddings(base)]
            self._calls = [
                self.run.hooks.method(entry, "__call__", self._on_call, lasting=True)
                for entry in entries
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
        if self.state in ("done", "ended") or model is None:  # the first step is over: nothing more to see here
            for handle in self._calls:
                self.run.hooks.discard(handle)
            self._calls = []
            return
        if not (torch.is_grad_enabled() and ckpt.unwrap(model).training):
            return
        if self.state == "first step":
            if self._updated_without_a_step():
                self.end("the model's parameters changed without a torch optimizer step (an update by hand?)")
            return
        if not probe.checkpointing_on(model):  # turned off again before training: nothing to guard
            self.end()
            return
        if self.state == "new":
            self.decide()
        facts = self.run.begin(self.run.args, model, asked=True)
        self.run.arm_first_step(facts, model)
        self._step = self.run.hooks.optimizer_step(self._on_step)
        self._tracked = _version_of(model)
        self.state = "first step"

    def _on_step(self, optimizer: Any) -> None:
        model = self.model_ref()
        if self.state != "first step" or self.run.stopped or model is None or not _steps(optimizer, model):
            return
        with contained("the model route", self._fail):
            self.run.before_optimizer_step(model)
            self.run.step_end(asked=True)
            self.state = "done"
            self.run.hooks.remove(keep_lasting=True)  # the enable guard stays; `__call__` goes at the next forward

    def _updated_without_a_step(self) -> bool:
        """The tracked parameter changed in place although no optimizer step of this model was seen."""
        if self._tracked is None:
            return False
        ref, version = self._tracked
        param = ref()
        return param is not None and param._version != version

    # --- the way out ----------------------------------------------------------------------------------------------

    def end(self, why: str | None = None) -> None:
        """Take the route off the model (what it repaired on the model stays: the loop goes on); `why` its first
        step's checks did not run, said once when they had not."""
        if why and self.waiting and self.run.settings.audit:
            report.note(f"{_name(self.model_ref())}: the first-step checks did not run: {why}.", "info")
        self.state = "ended"
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
    """What the decisions changed in the loop's kwargs, onto the model's checkpoint function (a Trainer would enable
    again with its arguments; a loop enabled once, before the plugin decided)."""
    for key in sorted(set(before) | set(after)):
        if key in ("every_n_layers", "offload"):
            continue  # layer arguments: transformers applied them at the enable call
        if before.get(key, _MISSING) != after.get(key, _MISSING):
            ckpt.set_keyword(model, key, after.get(key))


def _steps(optimizer: Any, model: Any) -> bool:
    """Whether `optimizer` steps `model`: it holds one of its trainable parameters, or (an optimizer over copies:
    DeepSpeed's partitions) some of them hold a gradient now. An optimizer of another model (a critic, a reward model)
    waits for nothing."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = {id(p) for p in trainable}
    groups = getattr(optimizer, "param_groups", None) or []
    if any(id(p) in ids for group in groups for p in group.get("params", ())):
        return True
    return any(p.grad is not None for p in trainable)


def _version_of(model: Any) -> tuple[weakref.ref[Any], int] | None:
    """The first trainable parameter and its version counter (an update bumps it; a forward, a backward and
    gradient accumulation do not); None under DeepSpeed ZeRO-3, whose partitions are swapped in and out."""
    for param in model.parameters():
        if param.requires_grad:
            return None if hasattr(param, "ds_id") else (weakref.ref(param), param._version)
    return None


def _name(model: Any) -> str:
    return type(ckpt.unwrap(model)).__name__ if model is not None else "a collected model"


_MISSING = object()


def _zero3_partitions(model: Any) -> dict[str, Any] | None:
    """`{"zero_optimization": {"stage": 3}}` when the model's parameters are DeepSpeed ZeRO-3 partitions (they carry
    `ds_id`); the first parameter tells (zero.Init partitions every parameter)."""
    first = next(iter(model.parameters()), None)
    return {"zero_optimization": {"stage": 3}} if first is not None and hasattr(first, "ds_id") else None


# --- the public call ---------------------------------------------------------------------------------------------


def guard(
    model: Any,
    mode: str | None = None,
    *,
    audit: bool | None = None,
    parity_check: bool | None = None,
    memory_budget: str | int | None = None,
    output_dir: str | None = None,
) -> list[Decision]:
    """Make checkpointing safe for `model` in a training loop without a `Trainer`: decide now with the rule table
    (refuse in strict mode, repair in fix mode, say what would change in warn mode), and check the first training
    step (the first forward, and the gradients before the first optimizer step).

    Call it after `model.gradient_checkpointing_enable(...)` and before the first training forward. With `install()`
    or `TRL_GC_PLUGIN=1` it is not needed: the enable call arms the same route for the first training forward.

    Args:
        model: the transformers model (or its PEFT / DDP wrapper).
        mode (`str`, *optional*): `strict`, `fix` or `warn`, as `SafeGCCallback`'s.
        audit / parity_check / memory_budget: as `SafeGCCallback`'s.
        output_dir (`str`, *optional*): where to write `gc_decisions.json` (an existing directory); defaults to
            `TRL_GC_PLUGIN_OUTPUT_DIR`, else no file.

    Returns:
        `list[Decision]`: the decisions taken (also logged).

    Raises:
        `GCConfigError`: in strict mode, for a setup known to break training (before any update).

    Example:
        ```python
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        decisions = trl_gc_plugin.guard(model, mode="fix")
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
        ```
    """
    given = {
        "mode": mode,
        "audit": audit,
        "parity_check": parity_check,
        "memory_budget": memory_budget,
        "output_dir": output_dir,
    }
    settings = GCSettings.resolve(given, caller="guard")
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


# --- the patched enable methods ----------------------------------------------------------------------------------

_ENABLED: WeakIdMap[tuple[dict[str, Any] | None]] = WeakIdMap()
"""What each model's last enable call was passed (while the patch is in place)."""


def claim(model: Any) -> None:
    """A Trainer route owns `model` from now on: a route armed for it goes, and later enable calls arm none."""
    base = ckpt.unwrap(model)
    _CLAIMED.set(base, True)
    route = _ROUTES.pop(base)
    if route is not None:
        route.end()


def _loop_kwargs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The enable call's arguments as the Trainer's checkpointing kwargs (`every_n_layers` / `offload` given as
    arguments are added to them)."""
    given = kwargs.get(f"{name.split('_', 1)[0]}_checkpointing_kwargs", args[0] if args else None)
    out = dict(given) if isinstance(given, dict) else None
    layer = {k: kwargs[k] for k in ("every_n_layers", "offload") if k in kwargs}
    layer.update(dict(zip(("every_n_layers", "offload"), args[1:3], strict=False)))
    layer = {
        k: v for k, v in layer.items() if not (k == "every_n_layers" and v == 1) and not (k == "offload" and not v)
    }
    if layer:
        out = {**(out or {}), **layer}
    return out


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


def is_patched() -> bool:
    return bool(_patched)


def end_all(when: str) -> None:
    """Every model route ends (`uninstall()`, the end of the process, `when`), saying so for those whose first step
    had not come."""
    for route in list(_ROUTES.values()):
        waited_for = "a training forward" if route.state in ("new", "decided") else "an optimizer step of the model"
        route.end(f"{when} before {waited_for}")


atexit.register(end_all, "the process ended")
