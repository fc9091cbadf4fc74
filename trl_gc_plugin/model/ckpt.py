"""The one owner of checkpointing on a live model: every write of `gradient_checkpointing` (the per-module flag)
and `_gradient_checkpointing_func` (transformers' `functools.partial(torch.utils.checkpoint.checkpoint, **keywords)`).

In front of that partial may stand the plugin's first-forward observer (`real()` looks behind it) and a launcher's
`functools.wraps` wrapper (LLaMA-Factory's: `inner()`, `wrapped()`), which every writer keeps, rebuilt around the new
partial. Why keep it: the wrapper does work of its own (LLaMA-Factory's `custom_gradient_checkpointing_func` makes the
hidden states require grad and skips frozen layers), chosen on purpose; a bare partial in its place would silently
drop that. `use_reentrant` and the other keywords are read from, and written into, the partial inside.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.capabilities import torch_checkpoint_keywords
from ..core.layout import Kind, Layout

FLAG = "gradient_checkpointing"
FUNC = "_gradient_checkpointing_func"


# wrappers whose `.module` is the model they wrap (FSDP1's root wrapper is what a Trainer's callbacks get)
_WRAPPERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def unwrap(model: Any) -> Any:
    """The underlying transformers model of a PEFT / DDP / FSDP1 / accelerate wrapper."""
    for _ in range(8):
        if callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        elif hasattr(model, "module") and type(model).__name__ in _WRAPPERS:
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner
    return model


def blocks(model: Any) -> list[Any]:
    """The `GradientCheckpointingLayer`s of `model` (not unwrapped), in module order; before transformers 4.52, the
    modules carrying a `gradient_checkpointing` flag that are not whole models."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52
        GradientCheckpointingLayer = None  # type: ignore[assignment,misc]
    from transformers import PreTrainedModel

    if GradientCheckpointingLayer is not None:
        return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return [m for m in model.modules() if hasattr(m, FLAG) and not isinstance(m, PreTrainedModel)]


def functions(model: Any) -> list[tuple[Any, Any]]:
    """(module, stored checkpoint function) for every module of `model` (not unwrapped) with checkpointing on."""
    return [(m, getattr(m, FUNC)) for m in model.modules() if getattr(m, FLAG, False) is True and hasattr(m, FUNC)]


def function_of(module: Any) -> Any:
    """The checkpoint function stored on `module` itself (None when it has none), the observer included."""
    return module.__dict__.get(FUNC)


def real(func: Any) -> Any:
    """The checkpoint function behind the plugin's first-forward observer (`func` itself when none stands in)."""
    return getattr(func, "original", func)


def inner(func: Any) -> Any:
    """The `functools.partial` a checkpoint function runs, behind the observer and `__wrapped__` wrappers; `real(func)`
    when no partial stands behind it (torch's `checkpoint` itself, an autograd Function's `apply`)."""
    base = real(func)
    found, seen = base, 0
    while not isinstance(found, functools.partial) and seen < 8:
        found, seen = getattr(found, "__wrapped__", None), seen + 1
        if found is None:
            return base
    return found if isinstance(found, functools.partial) else base


def wrapped(func: Any) -> bool:
    """Whether someone's own wrapper, chosen on purpose and to keep, stands around the checkpoint partial."""
    return inner(func) is not real(func)


def keywords(func: Any) -> dict[str, Any]:
    """A copy of the keywords a checkpoint function passes to torch's `checkpoint` (behind observer and wrapper)."""
    return dict(getattr(inner(func), "keywords", None) or {})


def use_reentrant(func: Any) -> bool:
    """The `use_reentrant` a checkpoint function really runs with (a missing key means torch's default: True)."""
    value = keywords(func).get("use_reentrant")
    return True if value is None else bool(value)


def model_use_reentrant(model: Any) -> bool | None:
    """The live model's `use_reentrant` (its first checkpointing module's), None when no module checkpoints."""
    funcs = functions(unwrap(model))
    return use_reentrant(funcs[0][1]) if funcs else None


def is_selective(func: Any) -> bool:
    """Whether a block's checkpoint function runs one of the planner's per-op policies (selective or lean)."""
    from .policies import lean_context, selective_context

    return keywords(func).get("context_fn") in (selective_context, lean_context)


def is_lean(func: Any) -> bool:
    from .policies import lean_context

    return keywords(func).get("context_fn") is lean_context


def layout_of(model: Any) -> Layout:
    """What the live model runs, block by block: each block's flag and checkpoint function."""
    return Layout(tuple(_kind_of(block) for block in blocks(unwrap(model))))


def _kind_of(block: Any) -> Kind:
    if getattr(block, FLAG, False) is not True:
        return "none"
    func = function_of(block)
    if getattr(real(func), "func", None) is offload_checkpoint:
        return "offload"
    if is_lean(func):
        return "lean"
    return "selective" if is_selective(func) else "full"


_functions = functions


def same(a: Any, b: Any) -> bool:
    """Equal partials, the same wrapper code around equal partials, or the same object."""
    if a is b:
        return True
    if wrapped(a) and wrapped(b):
        code_a, code_b = getattr(real(a), "__code__", None), getattr(real(b), "__code__", None)
        return code_a is not None and code_a is code_b and same(inner(a), inner(b))
    if not (isinstance(a, functools.partial) and isinstance(b, functools.partial)):
        return False
    return a.func is b.func and a.args == b.args and a.keywords == b.keywords


def _rewrapped(func: Any, new_inner: Any) -> Any:
    """A copy of the wrapper `func` around `new_inner` instead of its partial; None when it cannot be rebuilt."""
    wrapper, old = real(func), inner(func)
    if not isinstance(wrapper, types.FunctionType):
        return None
    copy = closure_swapped(wrapper, lambda content: new_inner if content is old else content)
    if copy is not None:
        copy.__wrapped__ = new_inner  # type: ignore[attr-defined]
    return copy


def closure_swapped(func: types.FunctionType, swap: Callable[[Any], Any]) -> types.FunctionType | None:
    """A copy of `func` whose closure cells hold `swap(content)`; None when `swap` changes no cell."""
    cells, changed = [], False
    for cell in func.__closure__ or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        new = swap(content)
        changed = changed or new is not content
        cells.append(cell if new is content else types.CellType(new))
    if not changed:
        return None
    copy = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, tuple(cells))
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__dict__.update(func.__dict__)
    copy.__qualname__ = func.__qualname__
    return copy


def offload_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's `checkpoint` with the saved inputs in pinned host memory (`save_on_cpu`); needs an accelerator."""
    import torch
    from torch.utils.checkpoint import checkpoint

    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return checkpoint(function, *args, **kwargs)


def with_keywords(func: Any, **changes: Any) -> Any:
    """A new partial of `func` (observer unwrapped) with `changes` set (`None` removes a key), the rest kept; a wrapper
    is rebuilt around it, or, when it cannot be, partial'ed itself (it passes the keywords on)."""
    if wrapped(func):
        rebuilt = _rewrapped(func, with_keywords(inner(func), **changes))
        if rebuilt is not None:
            return rebuilt
    base = real(func)
    if isinstance(base, functools.partial):
        target, args, kw = base.func, base.args, dict(base.keywords)
    else:
        target, args, kw = base, (), {}
    kw = {k: v for k, v in {**kw, **changes}.items() if k not in changes or v is not None}
    if kw.get("use_reentrant", True) is not False and _is_ours(kw.get("context_fn")):
        # torch takes a `context_fn` only under non-reentrant: the plugin's own goes with a switch to reentrant
        kw.pop("context_fn")
    return functools.partial(target, *args, **kw)


def _is_ours(context_fn: Any) -> bool:
    from .policies import is_ours

    return context_fn is not None and is_ours(context_fn)


def set_flag(module: Any, on: bool) -> None:
    """Switch checkpointing of one module on or off (its `gradient_checkpointing` flag); no write when it is so."""
    if getattr(module, FLAG, None) is not on:
        setattr(module, FLAG, on)


def set_function(module: Any, func: Any, behind_observer: bool = False) -> None:
    """Store `func` on one module; `behind_observer`: where the observer stands in, as the function it runs."""
    current = module.__dict__.get(FUNC)
    if behind_observer and current is not None and hasattr(current, "original"):
        current.original = func
    else:
        setattr(module, FUNC, func)


def set_keyword(model: Any, key: str, value: Any) -> int:
    """Make every checkpointing module's function run with `key=value` (`None` removes it), offloading and the other
    keywords kept; a module already so is left alone, a rewritten one loses the observer. Returns how many changed."""
    changed = 0
    for module, func in functions(unwrap(model)):
        func = real(func)
        inside = inner(func)
        present = inside.keywords if isinstance(inside, functools.partial) else {}
        if present.get(key) is value and (value is not None or key not in present):
            continue
        set_function(module, with_keywords(func, **{key: value}))
        changed += 1
    return changed


@dataclass(frozen=True)
class Spec:
    """How the blocks of a model checkpoint; `None` (or no key) leaves that part as it is. `keywords` are set in every
    block's function (`None` removes one); `none` / `full` blocks keep a user's own `context_fn`."""

    layout: Layout | None = None
    use_reentrant: bool | None = None
    keywords: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keywords", types.MappingProxyType(dict(self.keywords)))


def _function_for(current: Any, kind: Kind | None, spec: Spec) -> Any:
    """The checkpoint function a block holding `current` runs under `spec`, as `kind` (None: as it runs now)."""
    from torch.utils.checkpoint import checkpoint

    from .policies import lean_context, selective_context

    if wrapped(current):  # the wrapper is kept, around the partial the spec makes of the one inside it
        new = _function_for(inner(current), kind, spec)
        rebuilt = _rewrapped(current, new)
        return new if rebuilt is None else rebuilt
    base = real(current)
    if isinstance(base, functools.partial):
        func, args, kw = base.func, base.args, dict(base.keywords)
    else:
        func, args, kw = (base if callable(base) else checkpoint), (), {}
    if kind == "offload":
        func = offload_checkpoint
    elif kind is not None and func is offload_checkpoint:
        func = checkpoint
    if spec.use_reentrant is not None:
        kw["use_reentrant"] = spec.use_reentrant
    result = with_keywords(functools.partial(func, *args, **kw), **spec.keywords)
    if kind in ("selective", "lean"):
        policy = {"context_fn": lean_context if kind == "lean" else selective_context}
        if (
            "respect_saved_tensors_hooks" in torch_checkpoint_keywords()
            and "respect_saved_tensors_hooks" not in result.keywords
        ):
            # torch 2.14+ warns when a saved-tensor hooks context is around a selective region and will change what
            # it does there: the plugin's policies keep today's behaviour, said explicitly (a user's own value stays)
            policy["respect_saved_tensors_hooks"] = False
        return with_keywords(result, **policy)
    if kind is not None and result.keywords.get("context_fn") in (selective_context, lean_context):
        return with_keywords(result, context_fn=None)
    return result


def apply(model: Any, spec: Spec) -> None:
    """Apply `spec` to every block's flag and checkpoint function (idempotent; behind the observer; a block without
    a function gets torch's `checkpoint`). `ValueError` for selective with reentrant, or a layout of another size."""
    layout = spec.layout
    if spec.use_reentrant and layout is not None and any(layout.selective):
        raise ValueError("selective checkpointing needs use_reentrant=False (torch accepts context_fn only there)")
    found = blocks(unwrap(model))
    if layout is not None and len(found) != len(layout):
        raise ValueError(f"the plan is for {len(layout)} blocks; the model has {len(found)}")
    for i, block in enumerate(found):
        kind = layout.kinds[i] if layout is not None else None
        current = function_of(block)
        new = _function_for(current, kind, spec)
        if not same(real(current), new):
            set_function(block, new, behind_observer=True)
        if kind is not None:
            set_flag(block, kind != "none")


@dataclass(frozen=True)
class Snapshot:
    """A model's flags and stored checkpoint functions, for `restore()`; weakly held (it never keeps a model alive)."""

    flags: tuple[tuple[weakref.ref[Any], bool], ...]
    functions: tuple[tuple[weakref.ref[Any], Any], ...]

    def real_functions(self) -> dict[int, Any]:
        """{id(module): checkpoint function behind the observer}, for the modules still alive."""
        return {id(m): real(f) for ref, f in self.functions if (m := ref()) is not None}


def snapshot(
    model: Any, *, flags: bool = True, functions: bool = True, only: Collection[Any] | None = None
) -> Snapshot:
    """Record the flags and/or checkpoint functions (those of blocks switched off too) of `model`, or of `only`."""
    base = unwrap(model)
    keep = None if only is None else {id(m) for m in only}

    def wanted(module: Any) -> bool:
        return keep is None or id(module) in keep

    recorded_flags: tuple[tuple[weakref.ref[Any], bool], ...] = ()
    if flags:
        recorded_flags = tuple(
            (weakref.ref(m), flag)
            for m in base.modules()
            if wanted(m) and isinstance(flag := getattr(m, FLAG, None), bool)
        )
    recorded: dict[int, tuple[weakref.ref[Any], Any]] = {}
    if functions:
        for m, f in _functions(base):
            if wanted(m):
                recorded[id(m)] = (weakref.ref(m), f)
        for block in blocks(base):  # blocks switched off keep their function too
            func = function_of(block)
            if func is not None and wanted(block):
                recorded.setdefault(id(block), (weakref.ref(block), func))
    return Snapshot(flags=recorded_flags, functions=tuple(recorded.values()))


def restore(snap: Snapshot, keep_use_reentrant: bool = False) -> None:
    """Put back the recorded flags and checkpoint functions. `keep_use_reentrant` (the enable guard after a
    re-enable): rebuild each recorded partial or wrapper with the `use_reentrant` its module runs now, only where the
    module holds a function now."""
    for ref, on in snap.flags:
        if (module := ref()) is not None:
            set_flag(module, on)
    for ref, recorded in snap.functions:
        if (module := ref()) is None:
            continue
        now = function_of(module)
        if not keep_use_reentrant:
            if now is not recorded:
                set_function(module, recorded)
            continue
        want = real(recorded)
        if now is None or not isinstance(inner(want), functools.partial):
            continue
        mode = keywords(now).get("use_reentrant")
        restored = want if mode is None else with_keywords(want, use_reentrant=mode)
        if not same(restored, real(now)):
            set_function(module, restored)


# --- the recompute computes what the forward computed (policies.Faithful) -----------------------------------------

EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that hold an MoE layer's number of routed experts (Mixtral / GPT-OSS, Qwen-MoE / OLMoE / Jamba,
DeepSeek, ERNIE)."""


def router_shapes(model: Any) -> frozenset[tuple[int, int]]:
    """The (experts, hidden) shapes an MoE router's weight has in this model, from every config it reads."""
    shapes = set()
    configs = {id(m.config): m.config for m in unwrap(model).modules() if getattr(m, "config", None) is not None}
    for config in configs.values():
        hidden = getattr(config, "hidden_size", None)
        for name in EXPERT_COUNTS:
            experts = getattr(config, name, None)
            if isinstance(experts, int) and experts > 1 and isinstance(hidden, int):
                shapes.add((experts, hidden))
    return frozenset(shapes)


def router_of(block: Any, shapes: Collection[tuple[int, int]]) -> tuple[int, int] | None:
    """The (experts, hidden) of the router in `block`: a 2-D parameter of that shape (ZeRO-3's `ds_shape` read; FSDP1's
    flattened parameters hide it: None)."""
    if not shapes:
        return None
    for param in block.parameters():
        shape = tuple(getattr(param, "ds_shape", None) or param.shape)
        if len(shape) == 2 and shape in shapes:
            return (int(shape[0]), int(shape[1]))
    return None


def faithful_blocks(
    model: Any,
    shapes: Collection[tuple[int, int]] | None = None,
    before: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] | None = None,
) -> tuple[int, int, int]:
    """Give every non-reentrant block whose function runs no `context_fn` of a user's the plugin's (`Faithful`): the
    router's logits kept where the block has one, the forward's attention backend replayed in the recompute. Returns
    (blocks changed, blocks with a router found, non-reentrant blocks whose routing stays recomputed: a user's
    `context_fn` or no router found in a model that has one). `shapes`: `router_shapes(model)`, read once by a caller
    that repeats this at every re-enable (TRL's trainers re-enable every step). `before`: each changed block's
    (function before, function written), so that `unfaithful_blocks` gives back the very object the user or launcher
    set (an identity check of a launcher's wrapper holds after the run)."""
    from .policies import Faithful, faithful_of, is_ours

    base = unwrap(model)
    shapes = router_shapes(base) if shapes is None else shapes
    changed = routed = unrouted = 0
    for block in blocks(base):
        func = function_of(block)
        if func is None:
            continue
        kw = keywords(func)
        if kw.get("use_reentrant", True) is not False:
            continue
        current = kw.get("context_fn")
        if current is not None and not is_ours(current):
            unrouted += bool(shapes)
            continue
        if current is not None and faithful_of(current).keep != "full":  # the planner's selective / lean keep it
            continue
        router = router_of(block, shapes)
        routed += router is not None
        unrouted += bool(shapes) and router is None
        want = Faithful(router=router)
        if current == want:
            continue
        extra: dict[str, Any] = {"context_fn": want}
        if router is not None and "respect_saved_tensors_hooks" in torch_checkpoint_keywords():
            extra.setdefault("respect_saved_tensors_hooks", kw.get("respect_saved_tensors_hooks", False))
        written = with_keywords(real(func), **extra)
        set_function(block, written, behind_observer=True)
        if before is not None:
            before[block] = (real(func), written)
        changed += 1
    return changed, routed, unrouted


def unfaithful_blocks(model: Any, before: Mapping[Any, tuple[Any, Any]] | None = None) -> None:
    """Take the plugin's full-block `context_fn` back out (a run's end: the model runs as the user enabled it): the
    function `faithful_blocks` found goes back where the plugin's is still in place, else the plugin's is rebuilt
    without its `context_fn`."""
    from .policies import Faithful

    for block in blocks(unwrap(model)):
        func = function_of(block)
        found, written = (before or {}).get(block, (None, None))
        if func is not None and written is not None and real(func) is written:
            set_function(block, found, behind_observer=True)
            continue
        current = keywords(func).get("context_fn") if func is not None else None
        if isinstance(current, Faithful) and current.keep == "full":
            extra: dict[str, Any] = {"context_fn": None}
            if current.router is not None and keywords(func).get("respect_saved_tensors_hooks") is False:
                extra["respect_saved_tensors_hooks"] = None
            set_function(block, with_keywords(real(func), **extra), behind_observer=True)
