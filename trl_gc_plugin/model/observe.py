"""First-forward observation: what each checkpointed block really runs with, seen once, then gone.

Static facts can say for certain that a block's inputs will not require grad only in simple cases (nothing trainable
before the blocks). Everything else - learned position embeddings, embedding norms, token types, a trainable vision
tower, a user hook - is settled by looking: on the first training forward (module in train mode, grad enabled) of
each checkpointing *stack* (the module whose forward runs the checkpointed blocks: a decoder, an encoder, a vision
tower), a forward pre-hook for the stack wraps the checkpoint function of the modules under it for that one forward,
and a forward post-hook puts the originals back and removes both hooks. The hooks are process-wide ones that act on
the stack alone (`hooks.py`), so nothing is attached to the model: a copy of it made meanwhile carries nothing. Each wrapped call records which module it
checkpoints, the `use_reentrant` it really runs with, whether any positional tensor input requires grad (only
positional inputs count: transformers passes keyword arguments inside a `functools.partial`, which reentrant
checkpointing does not see) and whether the module holds trainable parameters.

Reentrant + trainable parameters + no positional input that requires grad is the silent failure, known before the
backward: `torch.utils.checkpoint`'s reentrant function returns outputs that do not require grad, so the block's
parameters get no gradient. The owner (the callback) decides what to do through `on_frozen`: raise, repair (the
call's first floating-point input is made to require grad, as transformers' `enable_input_require_grads` hook does),
or report. After the first step every hook that is still there (a stack that did not run) is removed, so the
steady-state cost is zero.

Works the same on transformers 4.x (where `GradientCheckpointingLayer` checkpoints in `__call__`) and 5.x (in
`forward`), and for models whose stack calls `self._gradient_checkpointing_func(layer.__call__, ...)` itself: the
checkpointed module is read off the function it is handed.
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

Verdict = Literal["raise", "repair", "report", "keep", "exact"]
"""What the owner wants done about a finding: `raise` (it raised already), `repair` (this call made safe; the owner
switches the run to non-reentrant), `report` (nothing changed), `keep` (run as asked: no evidence yet), `exact` (run
this one call non-reentrant, which is exact, until the evidence is in)."""


@dataclass(frozen=True)
class Call:
    """The first checkpointed call of one module.

    Args:
        module: its qualified name in the model (e.g. `model.layers.0`).
        reentrant: the `use_reentrant` it ran with (a missing key is torch's default: reentrant).
        inputs_require_grad: some positional tensor input required grad.
        trainable: the module holds trainable parameters.
        keyword_inputs: keyword arguments holding a tensor that requires grad (reentrant checkpointing does not see
            them as inputs: it backpropagates into their graph from inside its own backward).
    """

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

    seen = 0
    while seen < 8:
        seen += 1
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
        """A launcher's wrapper around the checkpoint call (`ckpt.wrapped`) may change the inputs before torch sees
        them (LLaMA-Factory's makes the hidden states require grad in place): the call is judged on the inputs as
        they are after it ran. A finding that asks for a repair runs the call once more, its input made to
        require grad (and non-reentrant when asked), before anything backpropagates through the first result."""
        result = self.original(function, *args, **kwargs)
        repaired, exact = self.observation.see(self, function, args)
        if exact or self.observation.last_repaired:
            original = ckpt.with_keywords(self.original, use_reentrant=False) if exact else self.original
            result = original(function, *repaired, **kwargs)
        return result


class Observation:
    """The one-shot observation of a model's first training forward.

    Args:
        model: the model (a PEFT or DDP wrapper is unwrapped).
        hooks (`Hooks`): the run's hooks, which the observation's go through.
        on_frozen: called with the `Call` of a block that loses its gradients; returns `"raise"` (the callback
            raises from inside it), `"repair"` or `"report"`.
        on_keyword_inputs: called with the `Call` of a reentrant block that gets a tensor requiring grad as a keyword
            argument, and the module that got the same tensor before (None the first time): two reentrant blocks
            backpropagating into the same graph from inside their own backward is "Trying to backward through the
            graph a second time". Returns a `Verdict`.
    """

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

    # --- set up / tear down ------------------------------------------------------------------------------------

    def stacks(self) -> dict[int, tuple[Any, list[Any]]]:
        """{id(stack): (stack, owners)}: the modules whose forward runs checkpointed blocks, and the modules under
        each that hold a checkpoint function."""
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
        stacks = self.stacks()
        for key, (stack, owners) in stacks.items():
            if key in self._handles or self._names.get(key) in self.observed_stacks:
                continue
            # outside the stack: a copy of the model made meanwhile carries nothing of the plugin (_hooks.py)
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

    # --- hooks ---------------------------------------------------------------------------------------------------

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
        """Record one checkpointed call; on a finding ask the owner (which may raise). Returns the (possibly
        repaired) arguments and whether to run this one call non-reentrant."""
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
    """The keyword arguments bound into the function a checkpoint runs (transformers passes a layer's keyword
    arguments that way: `partial(forward, self, **kwargs)`)."""
    seen = 0
    while isinstance(function, functools.partial) and seen < 8:
        if function.keywords:
            return function.keywords
        function, seen = function.func, seen + 1
    return None
