"""The model route: the plugin for training loops without a `Trainer` (OpenRLHF, verl, `accelerate` and plain PyTorch
loops), through the same `runtime.Run` the Trainer route drives.

Such a loop turns checkpointing on with `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`
(`activation_checkpointing_enable` on transformers >= 5.23) and has no `TrainingArguments` and no callback events.
The route stands in for both:

- the arguments are a `LoopConfig` holding what the loop passed to the enable call (its `use_reentrant` is the
  user's, as a value written in `TrainingArguments` is), and the launch facts the process shows (the world size of
  `torch.distributed` or the launcher's environment, a DeepSpeed config transformers holds for ZeRO-3, accelerate's
  environment);
- the events are the model's first training forward (decide, refuse or repair, install the first step's checks: a
  refusal comes before any backward) and the first optimizer step (`torch.optim`'s global step hooks: the gradient
  audit and the parity probe before any parameter update, then the first step's checks go).

Two ways in: `guard(model, ...)` after the enable call (decides at once, returns the decisions), and, under
`install()` / `TRL_GC_PLUGIN=1`, the patched enable methods of `PreTrainedModel`, which arm the route for the model's
first training forward. A model a Trainer manages (`claim`, called by `SafeGCCallback`) is the Trainer route's: the
model route stays silent for it. Undoing the patch restores the methods exactly; a route leaves no hook behind once
its first step is over.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._base import report
from .._base.weak import WeakIdMap
from ..core.decisions import Decision
from ..core.errors import GCConfigError
from ..core.settings import GCSettings
from ..model import ckpt, probe

if TYPE_CHECKING:
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
"""The route armed or running for each model."""
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
    """The plugin for one model trained without a Trainer.

    Args:
        model: the transformers model (or a wrapper of it) whose checkpointing the loop enabled.
        settings (`GCSettings`): the resolved settings.
        kwargs: what the loop passed to the enable call (None: nothing), or None with `known=False` when the route
            only sees the model (its checkpoint function's keywords: their author is unknown, so a value there is
            treated as set explicitly).
        output_dir: where `gc_decisions.json` goes, or None.
    """

    def __init__(
        self, model: Any, settings: GCSettings, kwargs: dict[str, Any] | None, known: bool, output_dir: str | None
    ) -> None:
        self.model_ref = weakref.ref(model)
        self.settings = settings
        self.kwargs = dict(kwargs) if kwargs is not None else None
        self.known = known
        self.output_dir = output_dir
        self.run: Run | None = None
        self._arming: list[Any] = []
        self._step_hooks = _StepHooks([])
        self._ids: set[int] | None = None
        self.broken = False
        self.done = False

    # --- arming: the first training forward ------------------------------------------------------------------

    def arm(self) -> None:
        """Start at the model's first training forward (grad enabled, training mode): a one-shot pre-hook on the input
        embeddings (called first in every forward, under any wrapper) and on the model itself."""
        model = self.model_ref()
        if model is None:
            return
        route = weakref.ref(self)
        targets = _entry_modules(model)
        ids = {id(t) for t in targets}

        def on_forward(module: Any, args: Any) -> None:
            import torch

            current = route()
            # a copy of the model (`copy.deepcopy` copies its hooks) is not this route's model
            if current is None or id(module) not in ids or not torch.is_grad_enabled() or not module.training:
                return
            current.start_guarded()

        self._arming = [t.register_forward_pre_hook(on_forward) for t in targets]

    def disarm(self) -> None:
        hooks, self._arming = self._arming, []
        for hook in hooks:
            hook.remove()

    def start_guarded(self) -> None:
        """`start()`, where a plugin bug never stops the loop: only a deliberate `GCConfigError` does."""
        try:
            self.start()
        except GCConfigError:
            raise
        except Exception as exc:
            self.fail(exc, "start")

    # --- the run -------------------------------------------------------------------------------------------------

    def start(self) -> list[Decision]:
        """Decide for the model and what the loop asked (refuse before anything runs, or apply), repair what the
        model runs, install the first step's checks and the optimizer-step hooks. Returns the decisions."""
        self.disarm()
        model = self.model_ref()
        if model is None or self.run is not None:
            return self.run.decisions if self.run is not None else []
        if not probe.checkpointing_on(model):  # turned off again before training: nothing to guard
            return []
        args = LoopConfig(output_dir=self.output_dir, deepspeed=_zero3_partitions(model))
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
        from ..runtime.run import Run

        run = self.run = Run(self.settings, cache_switch=False, route_facts=ROUTE_FACTS)
        before = dict(args.gradient_checkpointing_kwargs or {})
        run.init(args, model)
        self._sync_model(model, before, args.gradient_checkpointing_kwargs or {})
        run.begin(args, model, asked=True)
        self._install_step_hooks()
        return run.decisions

    @staticmethod
    def _sync_model(model: Any, before: dict[str, Any], after: dict[str, Any]) -> None:
        """What the decisions changed in the loop's kwargs, onto the model's checkpoint function (a Trainer would
        enable again with its arguments; a loop enabled once, before the plugin decided)."""
        for key in sorted(set(before) | set(after)):
            if key in ("every_n_layers", "offload"):
                continue  # layer arguments: transformers applied them at the enable call
            if before.get(key, _MISSING) != after.get(key, _MISSING):
                ckpt.set_keyword(model, key, after.get(key))

    def _install_step_hooks(self) -> None:
        """The first optimizer step's checks, from torch's global optimizer hooks (every optimizer a loop steps:
        `torch.optim`, accelerate's and DeepSpeed's wrap one); removed after that step."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        route = weakref.ref(self)

        def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
            current = route()
            if current is not None and current.steps(optimizer):
                current.before_step()

        def post(optimizer: Any, args: Any, kwargs: Any) -> None:
            current = route()
            if current is not None and current.steps(optimizer):
                current.after_step()

        self._step_hooks = _StepHooks([register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)])
        if self.run is not None:  # a refusal in the first forward (the session's stop) removes them with the checks
            self.run.session.checks.append(self._step_hooks)

    def steps(self, optimizer: Any) -> bool:
        """Whether `optimizer` steps this route's model: it holds one of its parameters, or (an optimizer over
        copies: DeepSpeed's partitions) some of them hold a gradient now. An optimizer of another model (a critic, a
        reward model) waits for nothing."""
        model = self.model_ref()
        if self.done or model is None or self.run is None or self.run.session.stopped:
            return False
        ids = self._ids
        if ids is None:
            ids = self._ids = {id(p) for p in model.parameters() if p.requires_grad}
        groups = getattr(optimizer, "param_groups", None) or []
        if any(id(p) in ids for group in groups for p in group.get("params", ())):
            return True
        return any(p.grad is not None for p in model.parameters() if p.requires_grad)

    def before_step(self) -> None:
        model = self.model_ref()
        if self.run is None or model is None or self.broken:
            return
        try:
            self.run.before_optimizer_step(model)
        except GCConfigError:
            self.stop()
            raise
        except Exception as exc:
            self.fail(exc, "the first optimizer step")

    def after_step(self) -> None:
        """The first step is over: its checks go. torch is iterating its step hooks now, so they are removed at the
        next forward (until then they return at once); the loop's later steps cost nothing."""
        if self.done:
            return
        self.done = True
        if self.run is not None and not self.broken:
            try:
                self.run.step_end(asked=True)
            except Exception as exc:
                self.fail(exc, "the end of the first step")
        self.stop(now=False, keep_repairs=True)

    def stop(self, now: bool = True, keep_repairs: bool = False) -> None:
        """Remove every trace of the route from the model and from torch's global hooks (`now=False`: the step hooks
        at the model's next forward, from a one-shot pre-hook: torch may be iterating them now). `keep_repairs`: the
        first step is over and the loop goes on with what the route repaired on the model (an input hook)."""
        self.disarm()
        if self.run is not None:
            checks = self.run.session.checks
            if self._step_hooks in checks:  # not removed by the session's stop, which may run inside a step hook
                checks.remove(self._step_hooks)
            self.run.stop(keep_repairs)
        if now:
            self._remove_step_hooks()
            return
        model = self.model_ref()
        if model is None or not self._step_hooks.handles:
            return
        route = weakref.ref(self)

        def cleanup(module: Any, args: Any) -> None:
            current = route()
            if current is not None:
                current._remove_step_hooks()

        self._arming = [t.register_forward_pre_hook(cleanup) for t in _entry_modules(model)]

    def _remove_step_hooks(self) -> None:
        self.disarm()
        self._step_hooks.remove()

    def fail(self, exc: BaseException, where: str) -> None:
        self.broken = True
        self.stop(now=False)
        report.note(
            f"internal error in the model route at {where} ({type(exc).__name__}: {exc}); training goes on without "
            "the plugin's checks. Please report it.",
            "warning",
        )


_MISSING = object()


class _StepHooks:
    """A route's two torch optimizer-step hooks, as a runtime check of its session (`remove`)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()


def _zero3_partitions(model: Any) -> dict[str, Any] | None:
    """`{"zero_optimization": {"stage": 3}}` when the model's parameters are DeepSpeed ZeRO-3 partitions (they carry
    `ds_id`); the first parameter tells (zero.Init partitions every parameter)."""
    first = next(iter(model.parameters()), None)
    return {"zero_optimization": {"stage": 3}} if first is not None and hasattr(first, "ds_id") else None


def _entry_modules(model: Any) -> list[Any]:
    """The modules every forward of `model` calls first: its input embeddings (under any wrapper, whatever calls
    `forward` directly) and the transformers model itself (a forward from `inputs_embeds`)."""
    base, emb = ckpt.unwrap(model), probe.embeddings(model)
    return [emb, base] if emb is not None else [base]


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
    from .post_init import installed_settings

    given = {
        "mode": mode,
        "audit": audit,
        "parity_check": parity_check,
        "memory_budget": memory_budget,
        "output_dir": output_dir,
    }
    settings = GCSettings.resolve(given, installed_settings(), caller="guard")
    report.setup()
    for line in settings.problems:
        report.note(f"{line}; using the default.", "warning")
    base = ckpt.unwrap(model)
    old = _ROUTES.get(base)
    if old is not None:
        old.stop()
    if not probe.checkpointing_on(base):
        report.note(
            "guard(): the model does not checkpoint; call model.gradient_checkpointing_enable(...) first.", "warning"
        )
        return []
    enabled = _ENABLED.get(base)
    known = enabled is not None
    route = ModelRoute(model, settings, enabled[0] if enabled else None, known, settings.output_dir)
    _ROUTES.set(base, route)
    return route.start()


# --- the patched enable methods ----------------------------------------------------------------------------------

_ENABLED: WeakIdMap[tuple[dict[str, Any] | None]] = WeakIdMap()
"""What each model's last enable call was passed (while the patch is in place)."""


def claim(model: Any) -> None:
    """A Trainer route owns `model` from now on: a route armed for it goes, and later enable calls arm none."""
    base = ckpt.unwrap(model)
    _CLAIMED.set(base, True)
    route = _ROUTES.get(base)
    if route is not None:
        route.stop()
        _ROUTES.pop(base)


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
            try:
                _after_enable(self, _loop_kwargs(name, args, kwargs))
            except Exception as exc:  # never let the plugin fail an enable call
                report.note(f"internal error in the model route ({type(exc).__name__}: {exc}); no checks", "warning")
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
    if old is not None and old.run is not None:
        return  # the route runs already (a re-enable mid-loop is not watched: a loop has no step events)
    if old is not None:
        old.disarm()
    from .post_init import installed_settings

    settings = GCSettings.resolve({}, installed_settings(), caller="TRL_GC_PLUGIN")
    route = ModelRoute(model, settings, kwargs, True, settings.output_dir)
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
    for route in list(_ROUTES.values()):
        if route.run is None:
            route.stop()


def is_patched() -> bool:
    return bool(_patched)
