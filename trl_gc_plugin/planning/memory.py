"""Measure what autograd keeps for the backward pass, per checkpointed block (`meter`, `measure`: saved-tensor hooks,
each storage once, parameters excluded), and estimate it without memory (`estimate`: the same meter on one fake-tensor
training forward; a config is built with two blocks and extrapolated). torch and transformers are imported lazily.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.layout import SELECTIVE, Kind, Layout
from ..model import ckpt, policies, probe


def storage_key(tensor: Any) -> int:
    """The C++ storage object's address: holds for `meta` and fake tensors too (`data_ptr()` is 0 there)."""
    return int(tensor.untyped_storage()._cdata)


def storage_nbytes(tensor: Any) -> int:
    return int(tensor.untyped_storage().nbytes())


def named_blocks(model: Any) -> list[tuple[str, Any]]:
    base = ckpt.unwrap(model)
    blocks = ckpt.blocks(base)
    names = {id(m): n for n, m in base.named_modules()}
    return [(names.get(id(b), f"<block {i}>"), b) for i, b in enumerate(blocks)]


PER_BLOCK = (
    "saved",
    "selective",
    "inputs",
    "input_saved",
    "matmul_flops",
    "other_bytes",
    "block_flops",
    "ops",
    "lean",
    "lean_matmul_flops",
)


@dataclass
class SavedBytes:
    """What one forward left for the backward pass, per block as `ActivationEstimate` names the fields: `saved` by the
    saved-tensor hooks, `selective` / `lean` in a policy's cache (cached, or what it would keep with checkpointing off).
    `mutated` / `lean_mutated`: blocks writing in place to an output that policy keeps (torch refuses it at backward).
    """

    blocks: list[str]
    saved: list[int]
    selective: list[int]
    inputs: list[int]
    input_saved: list[int] = field(default_factory=list)
    shared: int = 0
    kwargs_bytes: int = 0
    outside: int = 0
    matmul_flops: list[int] = field(default_factory=list)
    other_bytes: list[int] = field(default_factory=list)
    block_flops: list[int] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)
    outside_flops: int = 0
    lean: list[int] = field(default_factory=list)
    lean_matmul_flops: list[int] = field(default_factory=list)
    mutated: dict[int, str] = field(default_factory=dict)
    lean_mutated: dict[int, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.saved) + sum(self.selective) + self.shared + self.outside


def _flops(op: Any, args: tuple[Any, ...], out: Any) -> int:
    """FLOPs of a matmul or attention op (2 per multiply-add); 0 for anything else."""
    name = op.__name__.split(".")[0]
    try:
        if name in ("mm", "addmm"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            return 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if name == "_grouped_mm":  # (tokens, K) x (experts, K, N): each row by its own group's matrix
            a, b = args[0], args[1]
            rows = a.shape[0] * (a.shape[1] if a.dim() == 3 else 1)
            return 2 * rows * a.shape[-1] * b.shape[-1]
        if name in policies.BMM_NAMES:
            a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
            return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        if "attention" in name:
            q, k = args[0], args[1]
            return 4 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * q.shape[-1]
    except (AttributeError, IndexError, TypeError):
        return 0
    return 0


def _leaves(obj: Any) -> list[Any]:
    import torch

    return [t for t in torch.utils._pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _written(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None) -> list[Any]:
    """The tensors an aten op writes in place (its schema's `(a!)` arguments: `div_`'s self, an `out=`)."""
    found = []
    for i, argument in enumerate(func._schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) else (kwargs or {}).get(argument.name)
        found.extend(_leaves(value))
    return found


def _is_parameter(tensor: Any) -> bool:
    """A parameter, or a view of one (`mm` saves `t(W)`): excluded by what it is as well as by storage, because
    DeepSpeed ZeRO-3 gives a parameter a new storage each time it gathers it."""
    import torch

    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


class _Counter:
    """The shared state of one metering: where the forward is, what was seen, what was counted."""

    def __init__(self, names: list[str], held: list[Any]) -> None:
        self.index = {n: i for i, n in enumerate(names)}
        self.held = held  # the excluded storages, alive while metering (their keys stay theirs)
        self.exclude = {int(s._cdata) for s in held}
        self.stack: list[int] = []
        self.seen: dict[int, Any] = {}  # storage key -> storage, kept alive so keys are not reused
        # per policy (lean or not): storage key -> (block, op, storage) of the outputs it keeps
        self.kept: dict[bool, dict[int, tuple[int, str, Any]]] = {False: {}, True: {}}
        self.shared_keys: dict[int, Any] = {}
        self.input_keys: list[set[int]] = [set() for _ in names]
        self.report = SavedBytes(list(names), **{f: [0] * len(names) for f in PER_BLOCK})

    def where(self) -> int | None:
        return self.stack[-1] if self.stack else None

    def pack(self, tensor: Any) -> Any:
        import torch

        if isinstance(tensor, torch.Tensor) and not _is_parameter(tensor):
            key = storage_key(tensor)
            if key not in self.exclude and key not in self.seen:
                self.seen[key] = tensor.untyped_storage()
                nbytes = storage_nbytes(tensor)
                block = self.where()
                if key in self.shared_keys:
                    self.report.shared += nbytes
                elif block is None:
                    self.report.outside += nbytes
                else:
                    self.report.saved[block] += nbytes
                    if key in self.input_keys[block]:
                        self.report.input_saved[block] += nbytes
        return tensor

    def keep(self, outputs: Any, lean: bool = False, op: str = "") -> None:
        """Count op outputs the selective (or `lean`) policy keeps in the current block, each storage once."""
        block = self.where()
        if block is None:
            return
        into = self.report.lean if lean else self.report.selective
        for t in _leaves(outputs):
            key = storage_key(t)
            if key not in self.kept[lean]:
                self.kept[lean][key] = (block, op, t.untyped_storage())
                into[block] += storage_nbytes(t)

    def written(self, tensors: list[Any], op: str) -> None:
        """`op` wrote in place to `tensors`: a write to an output a policy keeps marks that block for the policy."""
        for t in tensors:
            key = storage_key(t)
            for lean, into in ((False, self.report.mutated), (True, self.report.lean_mutated)):
                if key in self.kept[lean]:
                    block, kept, _ = self.kept[lean][key]
                    into.setdefault(block, f"{kept}'s output, written in place by {op}")

    def enter(self, name: str, module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """A block's forward pre-hook (`functools.partial` binds `name`)."""
        i = self.index[name]
        self.stack.append(i)
        for t in _leaves(tuple(args)):
            self.report.inputs[i] += storage_nbytes(t)
            self.input_keys[i].add(storage_key(t))
        for t in _leaves(dict(kwargs)):
            key = storage_key(t)
            if key not in self.exclude and key not in self.shared_keys:
                self.shared_keys[key] = t.untyped_storage()
                self.report.kwargs_bytes += storage_nbytes(t)

    def leave(self, name: str, *hook_args: Any) -> None:
        if self.stack and self.stack[-1] == self.index[name]:
            self.stack.pop()

    def clear(self) -> None:
        self.held.clear()
        self.seen.clear()
        self.kept = {False: {}, True: {}}
        self.shared_keys.clear()


def _after_each_op(hook: Any) -> Any:
    """A dispatch mode calling `hook(func, args, kwargs, out)` after every op it runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AfterEachOp(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            hook(func, args, kwargs, out)
            return out

    return AfterEachOp()


def _would_keep_mode(counter: _Counter) -> Any:
    """A dispatch mode counting what the policies would keep on every op, the matmul FLOPs and the other ops' bytes."""
    state = policies.policy_state()

    def count(func: Any, args: Any, kwargs: Any, out: Any) -> None:
        block = counter.where()
        flops = _flops(func, args, out)
        if block is None:
            counter.report.outside_flops += flops
            return
        counter.report.block_flops[block] += flops
        counter.report.ops[block] += 1
        if getattr(getattr(func, "_schema", None), "is_mutable", False):
            counter.written(_written(func, args, kwargs), str(func))
        if policies.lean_keeps(func, args, state):
            counter.keep(out, lean=True, op=str(func))
            counter.report.lean_matmul_flops[block] += flops
        if policies.keeps(func, args, state):
            counter.keep(out, op=str(func))
            counter.report.matmul_flops[block] += flops
        else:
            inputs = {storage_key(t) for t in _leaves((args, kwargs))}
            counter.report.other_bytes[block] += sum(
                storage_nbytes(t) for t in _leaves(out) if storage_key(t) not in inputs
            )

    return _after_each_op(count)


def _counting_context(counter: _Counter, context: Any) -> Any:
    """A block's `context_fn` (`policies.Faithful`: selective, lean, or full with its router's logits kept) whose
    policy also counts what it keeps, SAC's cache being invisible to saved-tensor hooks. Where torch hands the policy
    the op's output (`SelectiveCheckpointContext.op_output`, torch 2.13+) the count rides in the policy and the
    forward context stays SAC's own caching mode, so torch passes `respect_saved_tensors_hooks` to it (torch 2.15
    warns about a context it cannot recognise); before that, a dispatch mode above the cache counts."""
    from torch.utils.checkpoint import SelectiveCheckpointContext, create_selective_checkpoint_contexts

    state = policies.policy_state()
    policy = context.policy()

    if "op_output" in inspect.signature(SelectiveCheckpointContext).parameters:

        def counting(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            decision = policy(ctx, op, *args, **kwargs)
            if decision is state["must_save"] and not ctx.is_recompute and ctx.op_output is not None:
                counter.keep(ctx.op_output)
            return decision

        return lambda: create_selective_checkpoint_contexts(counting)

    def count(func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if policy(None, func, *args, **kwargs) is state["must_save"]:
            counter.keep(out)

    def context_fn() -> tuple[Any, Any]:
        forward, recompute = create_selective_checkpoint_contexts(policy)
        return _entered_in_order(forward, _after_each_op(count)), recompute

    return context_fn


@contextlib.contextmanager
def _entered_in_order(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


@contextlib.contextmanager
def meter(model: Any, *, would_keep: bool = False, through: bool = False) -> Iterator[SavedBytes]:
    """Count what autograd keeps during the forward run inside (the yielded `SavedBytes` fills in place); run only the
    forward and the loss inside. `would_keep` (checkpointing off): also count what the policies would keep, and the
    FLOPs and bytes the cost model uses. On transformers 4.x a block's hooks run inside its checkpoint, so its saved
    inputs count as outside (the total is right). `through`: hand each counted tensor on to saved-tensor hooks already
    in scope (TRL's activation offloading, `save_on_cpu`), which innermost-wins would otherwise hide.
    """
    import torch

    base = ckpt.unwrap(model)
    blocks = named_blocks(base)
    # ZeRO-3 parameters (`ds_shape`) get a new storage at every gather, whose address an activation may reuse: they are
    # excluded by what they are (`_is_parameter`). The others are held while metering: FSDP1 swaps a parameter's data
    # between forwards, and a freed storage's address went to an activation (the logits, uncounted, on 2 CPU ranks)
    storages = [t.untyped_storage() for t in (*base.parameters(), *base.buffers()) if not hasattr(t, "ds_shape")]
    counter = _Counter([n for n, _ in blocks], storages)
    handles = []
    selective = [  # blocks whose context_fn keeps something: selective, lean, a kept router's logits
        b for _, b in blocks if getattr(b, ckpt.FLAG, False) and _keeps(getattr(b, ckpt.FUNC, None))
    ]
    saved = ckpt.snapshot(base, flags=False, only=selective)  # put back exactly what is swapped, nothing else
    for name, block in blocks:
        handles.append(
            block.register_forward_pre_hook(functools.partial(counter.enter, name), with_kwargs=True, prepend=True)
        )
        handles.append(block.register_forward_hook(functools.partial(counter.leave, name), always_call=True))
    for block in selective:
        func = getattr(block, ckpt.FUNC)
        context = policies.faithful_of(ckpt.keywords(func)["context_fn"])
        ckpt.set_function(block, ckpt.with_keywords(func, context_fn=_counting_context(counter, context)))
    mode = _would_keep_mode(counter) if would_keep else contextlib.nullcontext()
    pack, unpack = _saved_tensor_hooks(counter.pack, through)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:
            yield counter.report
    finally:
        for h in handles:
            h.remove()
        ckpt.restore(saved)
        counter.clear()


def _keeps(func: Any) -> bool:
    context = ckpt.keywords(func).get("context_fn") if func is not None else None
    faithful = policies.faithful_of(context)
    return faithful is not None and faithful.policy() is not None


def _saved_tensor_hooks(count: Any, through: bool) -> tuple[Any, Any]:
    """(pack, unpack): `count`, then (`through`) the saved-tensor hooks someone else has in scope."""
    import torch
    from torch.utils import checkpoint as checkpoint_module

    outer = None
    if through:
        current = getattr(checkpoint_module, "_current_user_saved_tensors_hooks", None)  # torch 2.15: past its own
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        outer = current() if current is not None else top(False) if top is not None else None
    if outer is None:
        return count, (lambda tensor: tensor)
    pack, unpack = outer
    return (lambda tensor: pack(count(tensor))), unpack


def measure(model: Any, batch: Mapping[str, Any], *, would_keep: bool = False) -> SavedBytes:
    """One forward of `model` (as it will train) on `batch` (model inputs with `labels`) under `meter`; nothing is
    trained."""
    with meter(model, would_keep=would_keep) as report:
        output = model(**batch)
        loss = getattr(output, "loss", None) if hasattr(output, "loss") else dict(output).get("loss")
        if loss is None:
            raise ValueError("measure() needs a batch with labels: the model returned no loss")
        del output, loss
    return report


@dataclass
class LiveBytes:
    """Bytes of the storages ops created under `live_bytes()` that are alive now (`current`), and their `peak`: what a
    step adds to weights and optimizer state already in place (not a kernel's scratch space)."""

    current: int = 0
    peak: int = 0
    _seen: set[int] = field(default_factory=set)

    def _add(self, storage: Any) -> None:
        import weakref

        key = int(storage._cdata)
        if key in self._seen:
            return
        nbytes = int(storage.nbytes())
        self._seen.add(key)
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes


@contextlib.contextmanager
def live_bytes() -> Iterator[LiveBytes]:
    """Track the tensor memory of what runs inside (forward and backward, any device) through a dispatch mode: for
    tests and benchmarks, it slows every op down."""
    tracker = LiveBytes()

    def track(func: Any, args: Any, kwargs: Any, out: Any) -> None:
        inputs = {storage_key(t) for t in _leaves((args, kwargs))}
        for t in _leaves(out):
            if storage_key(t) not in inputs:  # views and in-place results allocate nothing
                tracker._add(t.untyped_storage())

    with _after_each_op(track):
        yield tracker


@dataclass(frozen=True)
class ActivationEstimate:
    """What one training forward keeps per block, measured on fake tensors, at one batch size and sequence length.

    Per block: `saved` (when not checkpointed), `inputs` (its positional inputs: what a checkpointed block keeps),
    `input_saved` (the part of `saved` that is its inputs), `selective` / `lean` (what that policy's cache adds; `lean`
    empty where not measured), `grad_bytes` (trainable parameters), `block_flops` (matmul and attention),
    `matmul_flops` / `lean_matmul_flops` (of the ops that policy keeps), `other_bytes` (written by the other ops),
    `ops` (aten ops: selective pays a Python policy call for each).
    Besides: `shared` (the blocks' keyword tensors, saved by the first block not checkpointed), `kwargs_bytes` (all
    of them, alive the whole step), `outside` (saved by embeddings, final norm, head, loss), `loss_buffer_bytes` (one
    float32 `batch x seq x vocab`), `head_grad_bytes` (trainable parameters outside the blocks, whose gradients come
    before the blocks'), `embedding_grad_bytes` (untied input embeddings: last), `transient_bytes` (gradient buffers
    inside one block's backward: `batch x seq x (intermediate + hidden)`, plus the `s x s` scores with eager
    attention), `method` (`config` or `model`, with why a copy failed), `gathered_bytes` (sharded parameters held
    whole while a block or the head computes, set by the run), `selective_unsafe` / `lean_unsafe` (the first block
    writing in place to an output that policy keeps; "" when none).
    """

    blocks: tuple[str, ...]
    saved: tuple[int, ...]
    inputs: tuple[int, ...]
    input_saved: tuple[int, ...]
    selective: tuple[int, ...]
    shared: int
    kwargs_bytes: int
    outside: int
    loss_buffer_bytes: int
    grad_bytes: tuple[int, ...]
    head_grad_bytes: int
    embedding_grad_bytes: int
    transient_bytes: int
    block_flops: tuple[int, ...]
    matmul_flops: tuple[int, ...]
    other_bytes: tuple[int, ...]
    ops: tuple[int, ...]
    outside_flops: int
    batch_size: int
    seq_len: int
    dtype: str
    attn_implementation: str
    method: str
    measured_blocks: int
    gathered_bytes: int = 0
    lean: tuple[int, ...] = ()
    lean_matmul_flops: tuple[int, ...] = ()
    selective_unsafe: str = ""
    lean_unsafe: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def has_lean(self) -> bool:
        """Whether lean was measured and differs from selective somewhere."""
        return len(self.lean) == self.num_blocks and self.lean != self.selective

    def unsafe(self, kind: Kind) -> str:
        return self.lean_unsafe if kind == "lean" else self.selective_unsafe if kind == "selective" else ""

    def policy_bytes(self, i: int, kind: Kind) -> int:
        if kind == "lean" and self.lean:
            return self.lean[i]
        return self.selective[i] if kind in SELECTIVE else 0

    def kept(self, layout: Layout) -> list[int]:
        """Bytes each block keeps on the device under `layout`."""
        if len(layout) != self.num_blocks:
            raise ValueError(f"a layout for {self.num_blocks} blocks has {len(layout)} entries")
        return [
            self.saved[i] if k == "none" else 0 if k == "offload" else self.inputs[i] + self.policy_bytes(i, k)
            for i, k in enumerate(layout.kinds)
        ]

    def saved_bytes(self, layout: Layout) -> int:
        """Bytes kept for the backward pass under `layout` (what `meter` measures on the real run)."""
        shared = self.shared if not all(layout.pattern) else 0
        return self.outside + shared + sum(self.kept(layout))

    def blocks_times(self, factor: float, also: tuple[str, ...] = (), **changes: Any) -> ActivationEstimate:
        """This estimate with the blocks' saved figures, the shared bytes and the fields `also` times `factor`, and
        `changes` (`dataclasses.replace` keywords)."""

        def scale(value: Any) -> Any:
            return tuple(round(v * factor) for v in value) if isinstance(value, tuple) else round(value * factor)

        fields = ("saved", "inputs", "input_saved", "selective", "lean", "shared", *also)
        return dataclasses.replace(self, **{f: scale(getattr(self, f)) for f in fields}, **changes)


def _dtype_of(name: Any) -> Any:
    import torch

    if name is None or isinstance(name, torch.dtype):
        return name
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    text = str(name).replace("torch.", "").strip().lower()
    value = getattr(torch, aliases.get(text, text), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown floating-point dtype {name!r} (bf16, fp16, fp32)")
    return value


@contextlib.contextmanager
def _not_packed() -> Iterator[None]:
    """transformers 5 reads `position_ids` to detect packed sequences; on fake tensors it takes the batch as packed and
    builds a 4D mask the real run lacks. Make it return None as for a real unpacked batch (where 5.x does; 4.57 always
    builds the mask, also in a real run, so it is left alone; probed on a tiny real tensor)."""
    import torch

    try:
        import transformers.masking_utils as mu
    except ImportError:
        mu = None
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None or original(torch.arange(4).unsqueeze(0)) is not None:
        yield
        return
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


def config_dtype(config: Any) -> Any:
    """The dtype a config names (`dtype`, or `torch_dtype` before 5), without transformers 5's deprecation warning."""
    values = vars(config)
    return values.get("dtype") or values.get("torch_dtype")


def _param_bytes(module: Any, seen: set[int]) -> int:
    """Bytes of `module`'s trainable parameters not in `seen` (0 for None)."""
    total = 0
    for p in module.parameters() if module is not None else ():
        key = storage_key(p)
        if key in seen or not p.requires_grad:
            continue
        seen.add(key)
        total += storage_nbytes(p)
    return total


def _run_fake(
    model: Any,
    batch_size: int,
    seq_len: int,
    device: Any,
    total: int,
    method: str,
    attn: str,
    forward_kwargs: Mapping[str, Any] | None = None,
) -> ActivationEstimate:
    """One fake training forward (with the loss) of `model` under `meter`, as an `ActivationEstimate` for `total` blocks
    (the last measured block stands for those not built)."""
    import torch

    model.train()
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    with meter(model, would_keep=True) as report:
        out = model(input_ids=ids, labels=ids, **dict(forward_kwargs or {}))
        logits = getattr(out, "logits", None)  # none from TRL's fused LM head (per-token log-probs)
        vocab = int(logits.shape[-1]) if isinstance(logits, torch.Tensor) else _vocab_size(model)
        del out, logits
    if not any(report.ops) and not any(report.inputs):
        raise RuntimeError(
            "the fake forward did not run the model's blocks (a forward wrapper calls another copy of the model)"
        )
    base = ckpt.unwrap(model)
    seen: set[int] = set()
    grads = [_param_bytes(b, seen) for _, b in named_blocks(base)]
    head = _param_bytes(probe.embeddings(base, "output"), seen)
    embedding = _param_bytes(probe.embeddings(base), seen)
    head += _param_bytes(base, seen)  # final norm and anything else outside the blocks
    params = [p for p in base.parameters() if p.is_floating_point()]
    act = params[0].element_size() if params else 4
    n = len(report.blocks)
    names = report.blocks
    prefix = names[-1].rsplit(".", 1)[0] if names and "." in names[-1] else "layers"

    def extend(values: list[int]) -> tuple[int, ...]:
        return tuple(values) + (values[-1],) * (total - n)

    config = base.config
    return ActivationEstimate(
        blocks=tuple(names) + tuple(f"{prefix}.{i}" for i in range(n, total)),
        **{f: extend(getattr(report, f)) for f in PER_BLOCK},
        shared=report.shared,
        kwargs_bytes=report.kwargs_bytes,
        outside=report.outside,
        loss_buffer_bytes=batch_size * seq_len * vocab * 4,
        grad_bytes=extend(grads),
        head_grad_bytes=head,
        embedding_grad_bytes=embedding,
        transient_bytes=_transient(config, attn, batch_size, seq_len, act),
        outside_flops=report.outside_flops,
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=str(params[0].dtype if params else torch.float32).replace("torch.", ""),
        attn_implementation=attn,
        method=method,
        measured_blocks=n,
        selective_unsafe=_first_write(report.mutated, names),
        lean_unsafe=_first_write(report.lean_mutated, names),
    )


def _first_write(mutated: Mapping[int, str], names: list[str]) -> str:
    if not mutated:
        return ""
    block = min(mutated)
    more = f" (and {len(mutated) - 1} more blocks)" if len(mutated) > 1 else ""
    return f"{names[block]}: {mutated[block]}{more}"


def _vocab_size(model: Any) -> int:
    weight = getattr(probe.embeddings(model, "output"), "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return int(getattr(ckpt.unwrap(model).config.get_text_config(), "vocab_size", 0) or 0)


def _transient(config: Any, attn: str, batch_size: int, seq_len: int, act: int) -> int:
    """The gradient buffers alive inside one block's backward besides its saved activations: `batch x seq x
    (intermediate + hidden)` elements of the activation dtype, and with eager attention the `s x s` scores' gradient
    per head. An analytic bound from the config, not a measurement."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    sizes = (getattr(config, name, None) for name in ("intermediate_size", "ffn_dim", "n_inner", "d_ff"))
    intermediate = next((v for v in sizes if isinstance(v, int) and v > 0), 4 * hidden)
    size = batch_size * seq_len * (intermediate + hidden) * act
    if attn == "eager":
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        size += batch_size * heads * seq_len * seq_len * act
    return size


def _estimate_config(config: Any, batch_size: int, seq_len: int, dtype: Any, attn: str) -> ActivationEstimate:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    cfg.use_cache = False
    total = int(cfg.num_hidden_layers)
    if total < 1:
        raise ValueError(f"num_hidden_layers must be >= 1, got {total}")
    types = getattr(cfg, "layer_types", None)
    n = total if isinstance(types, list | tuple) and len(set(types)) > 1 else min(2, total)
    cfg.num_hidden_layers = n
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n]
    cfg._attn_implementation = attn
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with _not_packed(), FakeTensorMode():
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
            return _run_fake(model, batch_size, seq_len, torch.device("cpu"), total, "config", attn)
    finally:
        torch.set_default_dtype(previous)


def _fake_copy(base: Any, fake_mode: Any) -> Any:
    """A fake-tensor copy of `base`, checkpointing off, without hooks (the plugin's one-shot observers must not fire on
    it; the input-require-grad hook is put back)."""
    from torch._subclasses.fake_tensor import FakeCopyMode

    memo: dict[int, Any] = {}
    _whole_partitioned(base, fake_mode, memo)
    for module in base.modules():
        for name, hooks in vars(module).items():
            if "_hooks" in name and isinstance(hooks, dict):  # _forward_hooks, ..., _load_state_dict_post_hooks
                memo[id(hooks)] = type(hooks)()
        func = ckpt.function_of(module)
        if func is not None:
            memo[id(func)] = func
    input_hooked = probe.input_grad_hooks(base) > 0
    with FakeCopyMode(fake_mode):
        fake = copy.deepcopy(base, memo)
    for original, module in zip(base.modules(), fake.modules(), strict=True):
        if "forward" in module.__dict__:  # a forward wrapper (TRL's fused LM head, accelerate's autocast, a user's)
            module.forward = _rebound(original.__dict__["forward"], memo, 0)
        if getattr(module, ckpt.FLAG, False) is True:
            ckpt.set_flag(module, False)
    if input_hooked:
        fake_embeddings = probe.embeddings(fake)
        if fake_embeddings is not None:
            fake_embeddings.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    return fake


def _whole_partitioned(base: Any, fake_mode: Any, memo: dict[int, Any]) -> None:
    """A whole-shape fake parameter in `memo` for each one ZeRO-3 partitioned (`ds_shape`; empty between gathers)."""
    import torch

    for p in base.parameters():
        shape = getattr(p, "ds_shape", None)
        if shape is None or tuple(p.shape) == tuple(shape):
            continue
        with fake_mode:
            whole = torch.empty(tuple(shape), dtype=p.dtype, device=p.device)
        memo[id(p)] = torch.nn.Parameter(whole, requires_grad=p.requires_grad)


def _rebound(value: Any, memo: dict[int, Any], depth: int) -> Any:
    """`value` (a forward wrapper, or what it closes over or binds, a few levels deep) pointing at the fake copy's
    modules instead of the original's: TRL's `add_fused_lm_head` keeps `original_forward = model.forward` in its
    closure, so a plain deep copy's forward would run the original model."""
    import types

    import torch

    if depth > 6:
        return value
    if isinstance(value, torch.nn.Module):
        copied = memo.get(id(value))
        return copied if isinstance(copied, torch.nn.Module) else value
    if isinstance(value, types.MethodType):
        owner = _rebound(value.__self__, memo, depth + 1)
        func = _rebound(value.__func__, memo, depth + 1)
        return value if owner is value.__self__ and func is value.__func__ else types.MethodType(func, owner)
    if isinstance(value, functools.partial):
        func = _rebound(value.func, memo, depth + 1)
        args = tuple(_rebound(a, memo, depth + 1) for a in value.args)
        keywords = {k: _rebound(v, memo, depth + 1) for k, v in value.keywords.items()}
        same = func is value.func and all(a is b for a, b in zip(args, value.args, strict=True))
        if same and all(keywords[k] is v for k, v in value.keywords.items()):
            return value
        return functools.partial(func, *args, **keywords)
    if isinstance(value, types.FunctionType):
        return ckpt.closure_swapped(value, lambda content: _rebound(content, memo, depth + 1)) or value
    return value


def _estimate_model(
    model: Any, batch_size: int, seq_len: int, dtype: Any, attn: str | None, forward_kwargs: Mapping[str, Any] | None
) -> ActivationEstimate:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    base = ckpt.unwrap(model)
    params = list(base.parameters())
    device = params[0].device if params else torch.device("cpu")
    model_dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    if dtype is not None and dtype != model_dtype:
        raise ValueError(f"the model's parameters are {model_dtype}; estimate it as it is (dtype=None)")
    attn = _attn(base.config, attn)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _not_packed():
        fake = _fake_copy(base, fake_mode)
        fake.config._attn_implementation = attn
        for sub in probe.model_configs(fake):
            sub.use_cache = False
        with fake_mode:
            blocks = len(named_blocks(fake))
            return _run_fake(fake, batch_size, seq_len, device, blocks, "model", attn, forward_kwargs)


def _attn(config: Any, attn: str | None) -> str:
    return attn or getattr(config, "_attn_implementation", None) or "sdpa"


def estimate(
    model_or_config: Any,
    batch_size: int,
    seq_len: int,
    *,
    dtype: Any = None,
    attn_implementation: str | None = None,
    forward_kwargs: Mapping[str, Any] | None = None,
) -> ActivationEstimate:
    """Estimate what one training forward (with the model's own loss) keeps for the backward pass, per block, on fake
    tensors, for a live model (copied with its layout: PEFT adapters, frozen parameters; from its config, `method` says
    why, where the copy fails) or a `PretrainedConfig` (in `dtype`, default the config's, else float32).
    `forward_kwargs`: the real call's non-tensor keyword arguments, so that the fake forward takes its path (TRL's
    `fused_lm_head=True`); dropped where that path cannot run on fake tensors.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    from transformers import PretrainedConfig

    torch_dtype = _dtype_of(dtype)
    with _quiet_fake_kernels():
        if isinstance(model_or_config, PretrainedConfig):
            config = model_or_config
            torch_dtype = torch_dtype or _dtype_of(config_dtype(config) or "float32")
            return _estimate_config(config, batch_size, seq_len, torch_dtype, _attn(config, attn_implementation))
        args = (model_or_config, batch_size, seq_len, torch_dtype, attn_implementation)
        try:
            if forward_kwargs:
                try:
                    return _estimate_model(*args, forward_kwargs)
                except ValueError:
                    raise
                except Exception:  # that path cannot run on fake tensors (data-dependent shapes): the model's own loss
                    pass
            return _estimate_model(*args, None)
        except ValueError:
            raise
        except Exception as exc:  # a layout the fake copy cannot run: fall back to the config
            base = ckpt.unwrap(model_or_config)
            params = [p for p in base.parameters() if p.is_floating_point()]
            fallback = _dtype_of(torch_dtype or (params[0].dtype if params else "float32"))
            attn = _attn(base.config, attn_implementation)
            result = _estimate_config(base.config, batch_size, seq_len, fallback, attn)
            return dataclasses.replace(
                result, method=f"config (the fake copy of the model failed: {type(exc).__name__}: {exc})"
            )


@contextlib.contextmanager
def _quiet_fake_kernels() -> Iterator[None]:
    """torch logs a traceback at error level when a kernel cannot run on fake tensors (`_grouped_mm` takes bf16 only
    on meta in torch 2.13), before it raises; the estimate says why in one line instead."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
