"""Measure what autograd keeps for the backward pass, per checkpointed block, and estimate it without memory.

Two instruments, one accounting:

- `meter(model)` / `measure(model, batch)`: saved-tensor hooks count the bytes autograd saves during one real
  forward, per block (the model's `GradientCheckpointingLayer`s) and outside the blocks (embeddings, final norm,
  head, loss). Parameters and buffers are excluded by storage (so `t(W)`, which `mm` saves, is excluded too), each
  storage is counted once, and tensors handed to the blocks as keyword arguments (rotary `cos`/`sin`, masks) are
  counted apart (`shared`). What a live selective checkpoint keeps (its cache is invisible to saved-tensor hooks) is
  counted by the policy itself.
- `estimate(model_or_config, batch_size, seq_len)`: the same meter on one training forward under `FakeTensorMode`:
  shapes, dtypes and kernel choices are the real ones, but no tensor memory is allocated and no weight is read. A
  config is built with two blocks and extrapolated; a live model is copied as fake tensors with its own layout
  (PEFT adapters, frozen parameters).

What the selective policies keep (`model.policies`) is counted with their own test of each op.
torch and transformers are imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.layout import SELECTIVE, Kind, Layout
from ..model import ckpt, policies, probe

# --- the meter ---------------------------------------------------------------------------------------------------


def storage_key(tensor: Any) -> int:
    """Identity of a tensor's storage that also holds for `meta` and fake tensors (where `data_ptr()` is 0): the
    address of the C++ storage object. Views share it. Valid while the storage is alive (the meter keeps it so)."""
    return int(tensor.untyped_storage()._cdata)


def storage_nbytes(tensor: Any) -> int:
    return int(tensor.untyped_storage().nbytes())


def named_blocks(model: Any) -> list[tuple[str, Any]]:
    """The checkpointed blocks of `model` (as `ckpt.blocks` finds them), with their module names."""
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
"""The per-block figures a forward's `SavedBytes` counts and an `ActivationEstimate` extends to the whole model."""


@dataclass
class SavedBytes:
    """What one forward left for the backward pass.

    Args:
        blocks (`list[str]`): the checkpointed blocks, in forward order.
        saved (`list[int]`): bytes saved through autograd (saved-tensor hooks) inside each block.
        selective (`list[int]`): bytes of the op outputs the selective policy keeps in each block: what a live
            selective checkpoint really cached or, in an estimate (checkpointing off), what it would keep.
        inputs (`list[int]`): bytes of each block's positional tensor inputs (what a checkpointed block keeps).
        input_saved (`list[int]`): bytes of those inputs the block itself saves (counted in `saved` too).
        shared (`int`): bytes saved inside blocks from tensors the blocks receive as keyword arguments (rotary
            `cos`/`sin`, attention masks): saved once, by the first block that is not checkpointed.
        kwargs_bytes (`int`): bytes of all tensors the blocks receive as keyword arguments (alive for the whole step).
        outside (`int`): bytes saved outside the blocks (embeddings, final norm, head, loss).
        matmul_flops (`list[int]`): FLOPs of the ops the policy keeps, per block (estimate only).
        lean (`list[int]`): bytes the lean policy would keep in each block (estimate only).
        lean_matmul_flops (`list[int]`): FLOPs of the ops the lean policy keeps, per block (estimate only).
        other_bytes (`list[int]`): bytes written by the other ops (what selective recomputes), per block.
        block_flops (`list[int]`): FLOPs of every matmul in each block (estimate only).
        ops (`list[int]`): aten ops each block runs in one forward (estimate only).
        outside_flops (`int`): FLOPs of the matmuls outside the blocks (the head).
        mutated / lean_mutated (`dict[int, str]`): blocks where an op writes in place to an output the selective /
            lean policy keeps (estimate only), with the ops named: torch refuses that cache entry at the first
            backward, so the planner does not offer that policy.
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
        """Everything kept for the backward pass: hooks, selective caches, shared tensors, outside."""
        return sum(self.saved) + sum(self.selective) + self.shared + self.outside


def _flops(op: Any, args: tuple[Any, ...], out: Any) -> int:
    """FLOPs of a matmul or attention op (2 per multiply-add); 0 for anything else."""
    name = op.__name__.split(".")[0]
    try:
        if name == "mm":
            return 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
        if name == "_grouped_mm":  # (tokens, K) x (experts, K, N): each row by its own group's matrix
            a, b = args[0], args[1]
            rows = a.shape[0] * (a.shape[1] if a.dim() == 3 else 1)
            return 2 * rows * a.shape[-1] * b.shape[-1]
        if name == "addmm":
            return 2 * args[1].shape[0] * args[1].shape[1] * args[2].shape[1]
        if name in policies.BMM_NAMES:
            a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
            return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        if "attention" in name:
            q, k = args[0], args[1]
            batch = 1
            for d in q.shape[:-2]:
                batch *= d
            return 4 * batch * q.shape[-2] * k.shape[-2] * q.shape[-1]
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

    def __init__(self, names: list[str], exclude: set[int]) -> None:
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.exclude = exclude
        self.held: list[Any] = []  # the excluded storages, alive while metering (their keys stay theirs)
        self.stack: list[int] = []
        self.seen: dict[int, Any] = {}  # storage key -> storage, kept alive so keys are not reused
        self.kept_seen: dict[int, Any] = {}
        self.lean_seen: dict[int, Any] = {}
        self.kept_by: dict[int, tuple[int, str]] = {}  # storage key -> (block, op) that the selective policy keeps
        self.lean_by: dict[int, tuple[int, str]] = {}
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
        """Count op outputs the selective policy keeps (each storage once) for the current block; `lean`: what the
        lean policy would keep (an estimate counts both). `op` names the op, for `written`."""
        block = self.where()
        if block is None:
            return
        seen, into = (self.lean_seen, self.report.lean) if lean else (self.kept_seen, self.report.selective)
        by = self.lean_by if lean else self.kept_by
        for t in _leaves(outputs):
            key = storage_key(t)
            if key not in seen:
                seen[key] = t.untyped_storage()
                into[block] += storage_nbytes(t)
                by[key] = (block, op)

    def written(self, tensors: list[Any], op: str) -> None:
        """`op` wrote in place to `tensors`: a write to an output a policy keeps marks that block for the policy."""
        for t in tensors:
            key = storage_key(t)
            for by, into in ((self.kept_by, self.report.mutated), (self.lean_by, self.report.lean_mutated)):
                if key in by:
                    block, kept = by[key]
                    into.setdefault(block, f"{kept}'s output, written in place by {op}")

    def enter(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
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

    def leave(self, name: str) -> None:
        if self.stack and self.stack[-1] == self.index[name]:
            self.stack.pop()

    def clear(self) -> None:
        self.held.clear()
        self.seen.clear()
        self.kept_seen.clear()
        self.lean_seen.clear()
        self.shared_keys.clear()


def _would_keep_mode(counter: _Counter) -> Any:
    """A dispatch mode that runs the selective policy on every op (checkpointing off) and counts what it would keep,
    the FLOPs of the matmuls and the bytes the other ops write."""
    from torch.utils._python_dispatch import TorchDispatchMode

    state = policies.policy_state()

    class WouldKeep(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            block = counter.where()
            flops = _flops(func, args, out)
            if block is None:
                counter.report.outside_flops += flops
                return out
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
            return out

    return WouldKeep()


def _counting_context(counter: _Counter, lean: bool) -> Any:
    """A `context_fn` for the blocks that run `selective_context` (`lean_context` when `lean`): the same selective
    checkpoint, with a dispatch mode above its caching mode that counts the outputs the policy keeps (SAC's cache is
    invisible to saved-tensor hooks, and torch before 2.13 calls the policy before the op, without its output)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    state = policies.policy_state()
    keeps = policies.lean_keeps if lean else policies.keeps

    class CountKept(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if keeps(func, args, state):
                counter.keep(out)
            return out

    def context_fn() -> tuple[Any, Any]:
        forward, recompute = policies.lean_context() if lean else policies.selective_context()
        return _entered_in_order(forward, CountKept()), recompute

    return context_fn


@contextlib.contextmanager
def _entered_in_order(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


@contextlib.contextmanager
def meter(model: Any, *, would_keep: bool = False, through: bool = False) -> Iterator[SavedBytes]:
    """Count what autograd keeps during the forward run inside this context; the yielded `SavedBytes` is filled in
    place. Run only the forward (and the loss) inside: storages are held until exit so they are counted once.

    Blocks checkpointed with `selective_context` or `lean_context` are counted through a dispatch mode above their
    cache (what it keeps). With `would_keep=True` (checkpointing off), a dispatch mode runs the policies on every op
    and counts what each *would* keep, plus the FLOPs and bytes the cost model uses.

    On transformers 4.x a block's hooks run inside its checkpoint, after the checkpoint saved the block's inputs:
    those inputs are then counted outside the blocks (the total is right; 5.x attributes them to the block).

    `through`: a real training forward, around which a user may have saved-tensor hooks of their own (TRL's activation
    offloading, `save_on_cpu`, a meter): each tensor is counted, then handed to those hooks, which innermost-wins would
    otherwise hide for that forward. Not for the estimate's fake forward, which no one else's hooks may see.
    """
    import torch

    base = ckpt.unwrap(model)
    blocks = named_blocks(base)
    # a ZeRO-3 parameter (`ds_shape`) gets a new storage at every gather and release: its key now could be an
    # activation's later (the address reused), so such parameters are excluded by what they are (`_is_parameter`) only.
    # The other storages are held while metering: FSDP1 swaps a parameter's data between forwards (an empty placeholder
    # for a shard on another rank), and a freed storage's address, so its key, went to an activation (the logits,
    # uncounted, on 2 CPU ranks)
    storages = [t.untyped_storage() for t in (*base.parameters(), *base.buffers()) if not hasattr(t, "ds_shape")]
    counter = _Counter([n for n, _ in blocks], {int(s._cdata) for s in storages})
    counter.held = storages
    handles = []
    selective = [
        b for _, b in blocks if getattr(b, ckpt.FLAG, False) and ckpt.is_selective(getattr(b, ckpt.FUNC, None))
    ]
    saved = ckpt.snapshot(base, flags=False, only=selective)  # put back exactly what is swapped, nothing else
    for name, block in blocks:
        handles.append(
            block.register_forward_pre_hook(functools.partial(_pre_hook, counter, name), with_kwargs=True, prepend=True)
        )
        handles.append(block.register_forward_hook(functools.partial(_post_hook, counter, name), always_call=True))
    for block in selective:
        func = getattr(block, ckpt.FUNC)
        ckpt.set_function(block, ckpt.with_keywords(func, context_fn=_counting_context(counter, ckpt.is_lean(func))))
    mode = _would_keep_mode(counter) if would_keep else contextlib.nullcontext()
    outer = _hooks_in_scope() if through else None
    pack, unpack = (counter.pack, _identity) if outer is None else _through(counter.pack, *outer)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), mode:
            yield counter.report
    finally:
        for h in handles:
            h.remove()
        ckpt.restore(saved)
        counter.clear()


def _identity(tensor: Any) -> Any:
    return tensor


def _hooks_in_scope() -> tuple[Any, Any] | None:
    """The saved-tensor hooks someone else has in scope (a user's `save_on_cpu`, TRL's activation offloading, a meter
    of their own), which the meter's hooks would hide: innermost wins."""
    import torch
    from torch.utils import checkpoint as checkpoint_module

    current = getattr(checkpoint_module, "_current_user_saved_tensors_hooks", None)  # torch 2.15: past its own
    if current is not None:
        return current()
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _through(count: Any, pack: Any, unpack: Any) -> tuple[Any, Any]:
    """The meter's hooks around someone else's: each saved tensor is counted, then packed and unpacked by theirs, so
    the forward the meter watches runs as it would without it."""
    return (lambda tensor: pack(count(tensor))), unpack


def _pre_hook(counter: _Counter, name: str, module: Any, args: Any, kwargs: Any) -> None:
    counter.enter(name, args, kwargs)


def _post_hook(counter: _Counter, name: str, module: Any, args: Any, output: Any) -> None:
    counter.leave(name)


def measure(model: Any, batch: Mapping[str, Any], *, would_keep: bool = False) -> SavedBytes:
    """One forward of `model` on `batch` (a mapping of model inputs, with `labels` so the loss is part of it) under
    `meter`; the graph is dropped afterwards, nothing is trained.

    Args:
        model: the live model (PEFT and DDP wrappers are fine), in the state to measure (`train()`, checkpointing
            as it will run).
        batch: model inputs, e.g. `{"input_ids": ids, "labels": ids}`.
        would_keep: also count what the selective policy would keep (meant for checkpointing off).

    Returns:
        `SavedBytes`.
    """
    with meter(model, would_keep=would_keep) as report:
        output = model(**batch)
        loss = getattr(output, "loss", None) if hasattr(output, "loss") else dict(output).get("loss")
        if loss is None:
            raise ValueError("measure() needs a batch with labels: the model returned no loss")
        del output, loss
    return report


class LiveBytes:
    """Peak of the tensor memory created while it is active (`live_bytes()`): every new storage an op returns is
    counted until it is freed. Tensors that existed before are not counted, so on a model whose weights and
    optimizer state are in place the peak is what a step adds: activations, gradients, loss buffers, temporaries
    returned by ops (not the scratch space inside a kernel).

    Args:
        current (`int`): bytes alive now.
        peak (`int`): the largest `current` seen.
    """

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._seen: set[int] = set()

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
    """Measure the peak tensor memory of what runs inside (forward and backward; CPU and CUDA alike). A dispatch
    mode sees every op's outputs, autograd's backward ops included; a storage is counted once and uncounted when
    it is freed. For tests and benchmarks: it slows every op down."""
    from torch.utils._python_dispatch import TorchDispatchMode

    tracker = LiveBytes()

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            inputs = {storage_key(t) for t in _leaves((args, kwargs))}
            for t in _leaves(out):
                if storage_key(t) not in inputs:  # views and in-place results allocate nothing
                    tracker._add(t.untyped_storage())
            return out

    with Track():
        yield tracker


# --- the estimate ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationEstimate:
    """What one training forward keeps per block, measured on fake tensors, at one batch size and sequence length.

    Args:
        blocks (`tuple[str, ...]`): block names (`model.layers.0`, ...).
        saved (`tuple[int, ...]`): bytes a block keeps when it is not checkpointed.
        inputs (`tuple[int, ...]`): bytes a checkpointed block keeps (its positional inputs).
        input_saved (`tuple[int, ...]`): bytes of its inputs a block saves itself when not checkpointed (the
            recompute of a checkpointed block does not allocate them again).
        selective (`tuple[int, ...]`): bytes selective checkpointing keeps on top of the inputs.
        shared (`int`): tensors the blocks receive as keyword arguments, saved by the first block not checkpointed.
        kwargs_bytes (`int`): all tensors the blocks receive as keyword arguments (alive the whole step).
        outside (`int`): saved outside the blocks: embeddings, final norm, head input, loss (`log_softmax` output).
        logits_bytes (`int`): one `batch x seq x vocab` logits tensor in the model's dtype.
        loss_buffer_bytes (`int`): one `batch x seq x vocab` float32 tensor (the loss works in float32).
        grad_bytes (`tuple[int, ...]`): bytes of the trainable parameters of each block (their gradients).
        head_grad_bytes (`int`): trainable parameters outside the blocks whose gradients the backward allocates
            before the blocks' (final norm, head; tied embeddings).
        embedding_grad_bytes (`int`): trainable input embeddings not tied to the head (their gradient comes last).
        transient_bytes (`int`): the gradient buffers alive inside one block's backward besides its activations:
            `batch x seq x (intermediate size + hidden size)` elements of the activation dtype (plus the `s x s`
            scores' gradient with eager attention).
        block_flops (`tuple[int, ...]`): matmul and attention FLOPs of one forward of each block.
        matmul_flops (`tuple[int, ...]`): FLOPs of the ops selective keeps (not recomputed under selective).
        lean (`tuple[int, ...]`): bytes lean selective checkpointing (`lean_policy`) keeps on top of the inputs;
            empty where the estimate did not measure it (lean is then not planned).
        lean_matmul_flops (`tuple[int, ...]`): FLOPs of the ops lean selective keeps.
        selective_unsafe / lean_unsafe (`str`): why that policy cannot run here ("" when it can): the first block
            where an op writes in place to an output the policy keeps (`SavedBytes.mutated`).
        other_bytes (`tuple[int, ...]`): bytes the other ops write (recomputed under selective too).
        ops (`tuple[int, ...]`): aten ops one forward of each block runs (selective pays a Python policy call and
            a dispatch-mode round trip for each, twice).
        outside_flops (`int`): FLOPs outside the blocks (the head).
        batch_size, seq_len, dtype, attn_implementation: what was estimated.
        method (`str`): `config` (two blocks built from the config, extrapolated) or `model` (fake copy of the live
            model); with the reason when the copy could not be made.
        measured_blocks (`int`): how many blocks the fake forward ran.
        gathered_bytes (`int`): parameters held whole besides the activations while a block or the loss head
            computes: 0, except under DeepSpeed ZeRO-3 and FSDP2, which gather each module's sharded parameters for
            its forward and backward (set by the run, `sharding.gathered_parameter_bytes`).
    """

    blocks: tuple[str, ...]
    saved: tuple[int, ...]
    inputs: tuple[int, ...]
    input_saved: tuple[int, ...]
    selective: tuple[int, ...]
    shared: int
    kwargs_bytes: int
    outside: int
    logits_bytes: int
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
        """Whether the lean policy was measured (and differs from selective somewhere: else it is selective)."""
        return len(self.lean) == self.num_blocks and self.lean != self.selective

    def unsafe(self, kind: Kind) -> str:
        """Why `kind` cannot run on this model ("" when it can): a block writes in place to an output its policy
        keeps, which torch refuses at the first backward."""
        return self.lean_unsafe if kind == "lean" else self.selective_unsafe if kind == "selective" else ""

    def policy_bytes(self, i: int, kind: Kind) -> int:
        """Bytes block `i`'s selective cache holds when it runs `kind`: selective's, lean's, else 0."""
        if kind == "lean" and self.lean:
            return self.lean[i]
        return self.selective[i] if kind in SELECTIVE else 0

    def kept(self, layout: Layout) -> list[int]:
        """Bytes each block keeps on the device under `layout`: all it saves when not checkpointed, its inputs and its
        policy's cache when checkpointed, nothing when offloaded."""
        self._check(layout)
        return [
            self.saved[i] if k == "none" else 0 if k == "offload" else self.inputs[i] + self.policy_bytes(i, k)
            for i, k in enumerate(layout.kinds)
        ]

    def saved_bytes(self, layout: Layout) -> int:
        """Bytes kept for the backward pass under `layout` (what `meter` measures on the real run)."""
        shared = self.shared if not all(layout.pattern) else 0
        return self.outside + shared + sum(self.kept(layout))

    def _check(self, layout: Layout) -> None:
        if len(layout) != self.num_blocks:
            raise ValueError(f"a layout for {self.num_blocks} blocks has {len(layout)} entries")

    def blocks_times(self, factor: float, **changes: Any) -> ActivationEstimate:
        """This estimate with every per-block saved figure (and the bytes shared across blocks) times `factor`, and
        `changes` (`dataclasses.replace` keywords)."""

        def scale(values: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(round(v * factor) for v in values)

        return dataclasses.replace(
            self,
            saved=scale(self.saved),
            inputs=scale(self.inputs),
            input_saved=scale(self.input_saved),
            selective=scale(self.selective),
            lean=scale(self.lean),
            shared=round(self.shared * factor),
            **changes,
        )


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
    """transformers 5 reads `position_ids` to detect packed sequences; under fake tensors it cannot, takes the batch
    as packed, and builds a 4D mask the real run does not have (SDPA then saves an `s x s` mask per block). Make the
    check return what it returns for a real unpacked batch, where transformers itself returns None (5.x); 4.57 always
    builds the mask, and a real run does too, so it is left alone. Probed on a tiny real tensor."""
    import torch

    try:
        import transformers.masking_utils as mu
    except ImportError:
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None or original(torch.arange(4).unsqueeze(0)) is not None:
        yield
        return
    mu.find_packed_sequence_indices = _no_packing
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


def _no_packing(position_ids: Any) -> None:
    return None


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def config_dtype(config: Any) -> Any:
    """The dtype a config names (`dtype`, or `torch_dtype` on older releases), read without the deprecation warning
    transformers 5 gives for `torch_dtype`; None when it names none."""
    values = vars(config)
    return values.get("dtype") or values.get("torch_dtype")


def _is_config(obj: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(obj, PretrainedConfig)


def _uniform_layers(config: Any) -> bool:
    types = getattr(config, "layer_types", None)
    return not (isinstance(types, list | tuple) and len(set(types)) > 1)


def _param_bytes(module: Any, seen: set[int], trainable_only: bool = True) -> int:
    total = 0
    for p in module.parameters():
        key = storage_key(p)
        if key in seen or (trainable_only and not p.requires_grad):
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
    """One fake training forward (with the loss) of `model` under `meter`, turned into an `ActivationEstimate` for
    `total` blocks (the last measured block stands for the blocks not built). `forward_kwargs` are passed on (the
    real call's non-tensor keyword arguments, e.g. TRL's `fused_lm_head=True`). Raises `RuntimeError` when no
    block ran (the forward took a path around the copy's blocks: the estimate would say nothing about them)."""
    import torch

    model.train()
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    with meter(model, would_keep=True) as report:
        out = model(input_ids=ids, labels=ids, **dict(forward_kwargs or {}))
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):  # TRL's fused LM head returns per-token log-probs, no logits
            vocab, element = int(logits.shape[-1]), int(logits.element_size())
        else:
            vocab, element = _vocab_size(model), 4
        del out, logits
    if not any(report.ops) and not any(report.inputs):
        raise RuntimeError(
            "the fake forward did not run the model's blocks (a forward wrapper calls another copy of the model)"
        )
    base = ckpt.unwrap(model)
    seen: set[int] = set()
    grads = [_param_bytes(b, seen) for _, b in named_blocks(base)]
    head_module = probe.embeddings(base, "output")
    head = _param_bytes(head_module, seen) if head_module is not None else 0
    embeddings = probe.embeddings(base)
    embedding = _param_bytes(embeddings, seen) if embeddings is not None else 0
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
        logits_bytes=batch_size * seq_len * vocab * element,
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
    """Gradient buffers inside one block's backward besides its activations: `batch x seq x (intermediate + hidden)`
    elements, and with eager attention the gradient of the `s x s` scores."""
    size = batch_size * seq_len * (_intermediate(config) + int(getattr(config, "hidden_size", 0) or 0)) * act
    if attn == "eager":
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        size += batch_size * heads * seq_len * seq_len * act
    return size


def _intermediate(config: Any) -> int:
    for name in ("intermediate_size", "ffn_dim", "n_inner", "d_ff"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * int(getattr(config, "hidden_size", 0) or 0)


def _estimate_config(config: Any, batch_size: int, seq_len: int, dtype: Any, attn: str) -> ActivationEstimate:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    cfg.use_cache = False
    total = int(cfg.num_hidden_layers)
    if total < 1:
        raise ValueError(f"num_hidden_layers must be >= 1, got {total}")
    n = min(2, total) if _uniform_layers(cfg) else total
    cfg.num_hidden_layers = n
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n]
    cfg._attn_implementation = attn
    with _not_packed(), FakeTensorMode(), _default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
        return _run_fake(model, batch_size, seq_len, torch.device("cpu"), total, "config", attn)


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _fake_copy(base: Any, fake_mode: Any) -> Any:
    """A copy of `base` whose tensors are fake (no memory): hooks are not copied (the plugin's own one-shot
    observers must not fire on the copy; the input-require-grad hook is put back), checkpointing is off."""
    from torch._subclasses.fake_tensor import FakeCopyMode

    memo: dict[int, Any] = {}
    _whole_partitioned(base, fake_mode, memo)
    for module in base.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if hooks is not None:
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
            fake_embeddings.register_forward_hook(_require_grad_hook)
    return fake


def _whole_partitioned(base: Any, fake_mode: Any, memo: dict[int, Any]) -> None:
    """Put in `memo` a fake parameter of the whole shape for each parameter DeepSpeed ZeRO-3 partitioned (`ds_shape`;
    the rank holds an empty placeholder between gathers): the copy then runs the layout the real forward gathers."""
    import torch

    for p in base.parameters():
        shape = getattr(p, "ds_shape", None)
        if shape is None or tuple(p.shape) == tuple(shape):
            continue
        with fake_mode:
            whole = torch.empty(tuple(shape), dtype=p.dtype, device=p.device)
        memo[id(p)] = torch.nn.Parameter(whole, requires_grad=p.requires_grad)


def _rebound(value: Any, memo: dict[int, Any], depth: int) -> Any:
    """`value` (a forward wrapper, or something it closes over) pointing at the fake copy instead of the original
    model: a module of the original becomes its copy, a method bound to one is bound to the copy, and a function's
    closure and a partial's arguments are rebuilt the same way (a few levels deep). A wrapper installed as an instance
    attribute keeps the original forward in its closure (TRL's `add_fused_lm_head`: `original_forward =
    model.forward`); deep-copied as it is, the copy's forward would run the original model."""
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


def _require_grad_hook(module: Any, args: Any, output: Any) -> None:
    output.requires_grad_(True)


def _estimate_model(
    model: Any,
    batch_size: int,
    seq_len: int,
    dtype: Any,
    attn: str | None,
    forward_kwargs: Mapping[str, Any] | None = None,
) -> ActivationEstimate:
    if forward_kwargs:
        try:
            return _estimate_model_once(model, batch_size, seq_len, dtype, attn, forward_kwargs)
        except ValueError:
            raise
        except Exception:  # the call's path cannot run on fake tensors (data-dependent shapes): the model's own loss
            pass
    return _estimate_model_once(model, batch_size, seq_len, dtype, attn, None)


def _estimate_model_once(
    model: Any,
    batch_size: int,
    seq_len: int,
    dtype: Any,
    attn: str | None,
    forward_kwargs: Mapping[str, Any] | None,
) -> ActivationEstimate:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    base = ckpt.unwrap(model)
    params = list(base.parameters())
    device = params[0].device if params else torch.device("cpu")
    model_dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    if dtype is not None and dtype != model_dtype:
        raise ValueError(f"the model's parameters are {model_dtype}; estimate it as it is (dtype=None)")
    attn = attn or getattr(base.config, "_attn_implementation", None) or "sdpa"
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _not_packed():
        fake = _fake_copy(base, fake_mode)
        fake.config._attn_implementation = attn
        for sub in probe.model_configs(fake):
            sub.use_cache = False
        with fake_mode:
            blocks = len(named_blocks(fake))
            return _run_fake(fake, batch_size, seq_len, device, blocks, "model", attn, forward_kwargs)


def estimate(
    model_or_config: Any,
    batch_size: int,
    seq_len: int,
    *,
    dtype: Any = None,
    attn_implementation: str | None = None,
    forward_kwargs: Mapping[str, Any] | None = None,
) -> ActivationEstimate:
    """Estimate what one training forward (with the model's own language-modelling loss) keeps for the backward
    pass, per block, without allocating tensor memory: the meter runs on `FakeTensorMode` tensors.

    Args:
        model_or_config: a live model (its layout is copied as fake tensors: PEFT adapters, frozen parameters and
            the input-require-grad hook are honoured) or a `PretrainedConfig` (two blocks are built and the rest
            extrapolated; every block is run when `layer_types` mixes kinds).
        batch_size (`int`): sequences per device and step.
        seq_len (`int`): tokens per sequence.
        dtype (*optional*): for a config, the parameter and activation dtype (`torch.bfloat16`, `"bf16"`, ...;
            default: the config's `dtype`, else float32). A live model is estimated in its own dtype.
        attn_implementation (`str`, *optional*): `sdpa`, `eager`, ... (default: the model's or config's, else
            `sdpa`).
        forward_kwargs (`Mapping[str, Any]`, *optional*): non-tensor keyword arguments of the real training call,
            passed to the live model's fake forward so that it takes the same path (TRL's `fused_lm_head=True`);
            dropped when that path cannot run on fake tensors, and for a config.

    Returns:
        `ActivationEstimate`. A live model whose fake copy fails (quantized layers, custom kernels) is estimated from
        its config instead; `method` then says why.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
    with _quiet_fake_kernels():
        return _estimate(model_or_config, batch_size, seq_len, _dtype_of(dtype), attn_implementation, forward_kwargs)


@contextlib.contextmanager
def _quiet_fake_kernels() -> Iterator[None]:
    """torch logs a traceback at error level when a kernel cannot run on fake tensors (`_grouped_mm` takes bf16 only
    on meta in torch 2.13: Mixtral, Qwen3-MoE in float32), before it raises; the estimate catches the error and says
    why in one line, so the user's log gets no traceback. The logger's level is restored after."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _estimate(
    model_or_config: Any,
    batch_size: int,
    seq_len: int,
    torch_dtype: Any,
    attn_implementation: str | None,
    forward_kwargs: Mapping[str, Any] | None,
) -> ActivationEstimate:
    if _is_config(model_or_config):
        config = model_or_config
        if torch_dtype is None:
            torch_dtype = _dtype_of(config_dtype(config) or "float32")
        attn = attn_implementation or getattr(config, "_attn_implementation", None) or "sdpa"
        return _estimate_config(config, batch_size, seq_len, torch_dtype, attn)
    try:
        return _estimate_model(model_or_config, batch_size, seq_len, torch_dtype, attn_implementation, forward_kwargs)
    except ValueError:
        raise
    except Exception as exc:  # a layout the fake copy cannot run: fall back to the config
        base = ckpt.unwrap(model_or_config)
        params = [p for p in base.parameters() if p.is_floating_point()]
        fallback = _dtype_of(torch_dtype or (params[0].dtype if params else "float32"))
        attn = attn_implementation or getattr(base.config, "_attn_implementation", None) or "sdpa"
        result = _estimate_config(base.config, batch_size, seq_len, fallback, attn)
        return dataclasses.replace(
            result, method=f"config (the fake copy of the model failed: {type(exc).__name__}: {exc})"
        )
