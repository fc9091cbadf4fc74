"""First-forward observation: what each checkpointed block really runs with, seen once, then gone.

On the first training forward of each checkpointing stack, an `_Observer` stands in for the checkpoint function of the
modules under it (through `hooks.py`: nothing on the model). It records, per block, the `use_reentrant` it runs with,
whether a positional tensor input requires grad (reentrant checkpointing does not see the keyword arguments
transformers binds in a `functools.partial`) and whether it has trainable parameters. Reentrant + trainable + no such
input is the silent failure (the outputs do not require grad): the owner raises, repairs (the first floating-point
input made to require grad, as `enable_input_require_grads` does) or reports.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..core.errors import GCConfigError
from . import ckpt
from .hooks import Hooks

logger = logging.getLogger("trl_gc_plugin")

# what the owner wants done about a finding: `raise` (it raised already), `repair` (this call made safe), `report`
# (nothing changed), `keep` (run as asked: no evidence yet), `exact` (run this one call non-reentrant)
Verdict = Literal["raise", "repair", "report", "keep", "exact"]


@dataclass(frozen=True)
class Call:
    """The first checkpointed call of one module (`module`: its qualified name). `keyword_inputs`: keyword arguments
    holding a tensor that requires grad (reentrant checkpointing backpropagates into their graph from inside its own
    backward)."""

    module: str
    reentrant: bool
    inputs_require_grad: bool
    trainable: bool
    keyword_inputs: tuple[str, ...] = ()

    @property
    def loses_gradients(self) -> bool:
        """The silent failure: reentrant, trainable parameters, and no input that requires grad."""
        return self.reentrant and self.trainable and not self.inputs_require_grad


def _target(function: Any, owner: Any) -> Any:
    """The module a checkpoint function is asked to run: `partial(forward, self, ...)` (transformers 5),
    `partial(super().__call__, ...)` (4.x), `layer.__call__` (stacks that checkpoint their layers); else `owner`."""
    import torch

    for _ in range(8):
        if isinstance(function, functools.partial):
            if function.args and isinstance(function.args[0], torch.nn.Module):
                return function.args[0]
            function = function.func
            continue
        bound = getattr(function, "__self__", None)
        return bound if isinstance(bound, torch.nn.Module) else owner
    return owner


def _require_grad(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Make the first floating-point tensor argument require grad (a tensor that does not is always a leaf)."""
    import torch

    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_floating_point():
            arg.requires_grad_(True)
            break
    return args


class _Observer:
    """Stands in for one module's checkpoint function during one forward of its stack."""

    __slots__ = ("observation", "original", "owner")

    def __init__(self, observation: Observation, owner: Any, original: Any) -> None:
        self.observation, self.owner, self.original = observation, owner, original

    @property
    def keywords(self) -> dict[str, Any]:  # read by ckpt.use_reentrant
        return ckpt.keywords(self.original)

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        if ckpt.wrapped(self.original):
            return self._call_wrapper(function, args, kwargs)
        args, exact = self.observation.see(self, function, args)
        original = self.original
        if exact and isinstance(original, functools.partial):
            original = ckpt.with_keywords(original, use_reentrant=False)
        return original(function, *args, **kwargs)

    def _call_wrapper(self, function: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A launcher's wrapper may change the inputs (LLaMA-Factory's makes them require grad in place): the call is
        judged after it ran, and run once more, repaired, when a finding asks for that."""
        result = self.original(function, *args, **kwargs)
        repaired, exact = self.observation.see(self, function, args)
        if exact or self.observation.last_repaired:
            original = ckpt.with_keywords(self.original, use_reentrant=False) if exact else self.original
            result = original(function, *repaired, **kwargs)
        return result


class Observation:
    """The one-shot observation of a model's first training forward. `on_frozen` gets the `Call` of a block that loses
    its gradients; `on_keyword_inputs` that of a reentrant block with a keyword tensor requiring grad, and the module
    that got the same tensor before (two reentrant blocks backpropagating into one graph from inside their own
    backward is "Trying to backward through the graph a second time")."""

    def __init__(
        self,
        model: Any,
        hooks: Hooks,
        on_frozen: Callable[[Call], Verdict],
        on_keyword_inputs: Callable[[Call, str | None], Verdict] | None = None,
    ) -> None:
        base = ckpt.unwrap(model)
        self._base = weakref.ref(base)  # a run whose first step never ends keeps no model alive
        self.hooks = hooks
        self.on_frozen = on_frozen
        self.on_keyword_inputs = on_keyword_inputs
        self.calls: dict[str, Call] = {}
        self.eval_forwards = 0
        self._captured: dict[int, str] = {}
        self.observed_stacks: list[str] = []
        self.failures = 0
        self.last_repaired = False  # the last `see` made an input require grad
        self._names = {id(m): n for n, m in base.named_modules()}
        self._handles: dict[int, list[Any]] = {}
        self._active: dict[int, list[tuple[Any, _Observer]]] = {}

    def stacks(self) -> dict[int, tuple[Any, list[Any]]]:
        """{id(stack): (stack, the modules under it holding a checkpoint function)}."""
        try:
            from transformers.modeling_layers import GradientCheckpointingLayer
        except ImportError:  # transformers < 4.52: every owner calls its own function for its layers
            GradientCheckpointingLayer = ()  # type: ignore[assignment,misc]
        import torch

        base = self._base()
        if base is None:
            return {}
        parents = {id(child): parent for parent in base.modules() for child in parent.children()}
        containers = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)
        out: dict[int, tuple[Any, list[Any]]] = {}
        for owner, _ in ckpt.functions(base):
            stack = owner
            if isinstance(owner, GradientCheckpointingLayer):
                stack = parents.get(id(owner), owner)
                while isinstance(stack, containers) and id(stack) in parents:
                    stack = parents[id(stack)]
            out.setdefault(id(stack), (stack, []))[1].append(owner)
        return out

    def install(self) -> int:
        """Hook every checkpointing stack; returns how many. Safe to call again (hooks the stacks not hooked yet)."""
        for key, (stack, owners) in self.stacks().items():
            if key in self._handles or self._names.get(key) in self.observed_stacks:
                continue
            pre = self.hooks.forward_pre(stack, functools.partial(self._enter, key, owners))
            post = self.hooks.forward(stack, functools.partial(self._leave, key))
            self._handles[key] = [pre, post]
        return len(self._handles)

    def remove(self) -> None:
        """Put every function back and remove every hook (idempotent)."""
        for key in list(self._active):
            self._restore(key)
        for handles in self._handles.values():
            for handle in handles:
                self.hooks.discard(handle)
        self._handles.clear()

    @property
    def pending(self) -> bool:
        """Some stack is still hooked (has not run a training forward yet)."""
        return bool(self._handles)

    def _enter(self, key: int, owners: list[Any], module: Any, args: Any) -> None:
        import torch

        if key in self._active or not torch.is_grad_enabled():
            return
        if not module.training:  # transformers checkpoints only in train mode: this forward checkpoints nothing
            self.eval_forwards += 1
            return
        wrapped = []
        for owner in owners:
            func = getattr(owner, ckpt.FUNC, None)
            if func is None or isinstance(func, _Observer) or not getattr(owner, ckpt.FLAG, False):
                continue
            observer = _Observer(self, owner, func)
            ckpt.set_function(owner, observer)
            wrapped.append((owner, observer))
        self._active[key] = wrapped

    def _leave(self, key: int, module: Any, args: Any, output: Any) -> None:
        if key not in self._active:
            return
        self._restore(key)
        self.observed_stacks.append(self._names.get(key, type(module).__name__))
        for handle in self._handles.pop(key, []):
            self.hooks.discard(handle)

    def _restore(self, key: int) -> None:
        for owner, observer in self._active.pop(key, []):
            # a switch of mode during the forward (fix mode) replaced the observer: keep what is there now
            if ckpt.function_of(owner) is observer:
                ckpt.set_function(owner, observer.original)

    def see(self, observer: _Observer, function: Any, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], bool]:
        """Record one call, asking the owner on a finding; returns the arguments and whether to run it non-reentrant."""
        import torch

        self.last_repaired = False
        try:
            if not torch.is_grad_enabled():
                return args, False
            target = _target(function, observer.owner)
            name = self._names.get(id(target), type(target).__name__)
            keywords = {
                k: v for k, v in (_keywords(function) or {}).items() if isinstance(v, torch.Tensor) and v.requires_grad
            }
            call = Call(
                module=name,
                reentrant=ckpt.use_reentrant(observer.original),
                inputs_require_grad=any(isinstance(a, torch.Tensor) and a.requires_grad for a in args),
                trainable=any(p.requires_grad for p in target.parameters()),
                keyword_inputs=tuple(sorted(keywords)),
            )
            if name in self.calls:
                return args, False
            self.calls[name] = call
            shared = next((self._captured[id(v)] for v in keywords.values() if id(v) in self._captured), None)
            for v in keywords.values():
                self._captured.setdefault(id(v), name)
        except Exception:  # a plugin bug never stops training
            self.failures += 1
            logger.debug("trl_gc_plugin: first-forward observation failed", exc_info=True)
            return args, False
        exact = False
        if call.loses_gradients and self._ask(self.on_frozen, call) == "repair":
            args = _require_grad(args)
            self.last_repaired = True
        if call.reentrant and call.keyword_inputs and self.on_keyword_inputs is not None:
            exact = self._ask(self.on_keyword_inputs, call, shared) in ("repair", "exact")
        return args, exact

    def _ask(self, handler: Callable[..., Verdict], *details: Any) -> Verdict:
        try:
            return handler(*details)
        except GCConfigError:  # the one deliberate way out: the owner refuses the run
            raise
        except Exception:
            self.failures += 1
            logger.debug("trl_gc_plugin: first-forward verdict failed", exc_info=True)
            return "report"


def _keywords(function: Any) -> dict[str, Any] | None:
    """The keyword arguments bound into the function a checkpoint runs (`partial(forward, self, **kwargs)`)."""
    seen = 0
    while isinstance(function, functools.partial) and seen < 8:
        if function.keywords:
            return function.keywords
        function, seen = function.func, seen + 1
    return None
