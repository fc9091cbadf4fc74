"""The parity probe: every trainable parameter's gradient with checkpointing as it runs and without (the modules'
flags flipped), on one small batch. No gradient is kept: each is reduced as autograd produces it to `PROJECTIONS`
random sign projections (linear, so the pieces of one gradient add up; `E[<w, g>^2] = |g|^2`) and freed. RNGs, buffers,
number attributes, the run's gradients and train/eval mode are put back. A gradient missing (or all zero) only with
checkpointing is the silent failure; otherwise they must agree within `rtol * max(|g|, FLOOR * max |g|)`.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..model import ckpt
from ..model.hooks import Hooks

PROJECTIONS = 8
COLUMNS = 512
BLOCK = 1 << 22  # elements of a gradient converted to float32 at a time (16 MiB)
MAX_TOKENS = 16
MAX_BATCH_TOKENS = 8192  # the whole first batch is tried (after one sample failed) up to this many tokens
PARITY_RTOL = 1e-4
LOW_PRECISION_RTOL = 1e-2
FLOOR = 1e-3
FAR = 0.1
"""A relative L2 difference of one gradient far beyond numerical noise: bf16 noise on a GPU stays near 1e-3; a
recompute that routes MoE tokens to other experts gave 0.56-0.64 on the experts (tiny Mixtral, 5.23). Strict mode
refuses it before any update."""
MAJOR = 1e-2
"""A gradient counts for that when its size is at least this fraction of the largest one's (a near-zero gradient's
relative difference says nothing)."""
# a batch with only these keys is cut to `MAX_TOKENS` tokens
TEXT_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", "token_type_ids")


@dataclass
class ParityResult:
    """`max_rel`: the largest difference relative to a parameter's |g| without checkpointing."""

    compared: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    missing_with_checkpointing: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    skipped: str | None = None
    batch: str = ""
    rtol: float = PARITY_RTOL
    major_rel: float = 0.0
    """The largest relative L2 difference among the gradients of at least `MAJOR` of the largest one's size."""
    major: list[str] = field(default_factory=list)
    """Those of them beyond `FAR`, the largest difference first."""

    @property
    def far(self) -> bool:
        return self.major_rel > FAR

    @property
    def ok(self) -> bool:
        return not (self.missing_with_checkpointing or self.outside)


class Fingerprints:
    """Per parameter (by index in `params`, the same in both passes), the sum of its gradient pieces' projections."""

    def __init__(self, params: list[tuple[str, Any]], seed: int) -> None:
        import torch

        self.params = params
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self._columns = (torch.randint(0, 2, (COLUMNS, PROJECTIONS), generator=gen) * 2 - 1).float()
        self._on: dict[Any, Any] = {}
        self.sums: dict[int, Any] = {}

    def add(self, index: int, grad: Any) -> None:
        import torch

        flat = grad.detach().reshape(-1)
        total = torch.zeros(PROJECTIONS, dtype=torch.float64, device=flat.device)
        if flat.device not in self._on:
            self._on[flat.device] = self._columns.to(flat.device)
        v = self._on[flat.device]
        for start in range(0, flat.numel(), BLOCK):
            piece = flat[start : start + BLOCK].float()
            short = (-piece.numel()) % COLUMNS
            if short:
                piece = torch.nn.functional.pad(piece, (0, short))
            rows = piece.view(-1, COLUMNS) @ v  # (rows, PROJECTIONS)
            u = self._signs(rows.shape, rows.device, hash((self.seed, index, start)) & 0x7FFF_FFFF_FFFF)
            total += (rows.double() * u).sum(0)
        self.sums[index] = self.sums.get(index, 0) + total

    def _signs(self, shape: Any, device: Any, seed: int) -> Any:
        """Random +-1 (float64) drawn on the gradient's device: a host draw and copy per block made the probe's
        backward synchronous (0.73 s of a 1.2 s probe on a 1.5B model on an H200)."""
        import torch

        try:
            gen = torch.Generator(device=device).manual_seed(seed)
            draw = torch.randint(0, 2, shape, generator=gen, device=device)
        except RuntimeError:  # a device without its own generator: draw on the host
            gen = torch.Generator().manual_seed(seed)
            draw = torch.randint(0, 2, shape, generator=gen).to(device)
        return (draw * 2 - 1).to(torch.float64)

    def values(self) -> dict[int, list[float]]:
        return {i: [float(x) for x in t.tolist()] for i, t in self.sums.items()}


@contextmanager
def fingerprinting(prints: Fingerprints) -> Iterator[None]:
    """Each gradient reduced to its fingerprint and freed the moment autograd accumulates it."""
    handles = []

    def reduce_and_free(index: int, param: Any) -> None:
        if param.grad is not None:
            prints.add(index, param.grad)
            param.grad = None

    try:
        for index, (_, param) in enumerate(prints.params):
            handles.append(param.register_post_accumulate_grad_hook(functools.partial(reduce_and_free, index)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def first_sample(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The first sample of a forward's inputs, copied (text cut to `MAX_TOKENS` tokens); None without one."""
    import torch

    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() >= 1]
    if not tensors:
        return None
    batch = tensors[0].shape[0]
    text = not args and all(k in TEXT_KEYS for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() >= 2)

    def take(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch:
            return value
        one = value[:1]
        if text and one.dim() == 2:
            one = one[:, :MAX_TOKENS]
        return one.detach().clone()

    return tuple(take(a) for a in args), {k: take(v) for k, v in kwargs.items() if k != "num_items_in_batch"}


class FirstInputs:
    """The first training forward's inputs, seen by a process-wide hook: nothing is attached to the model."""

    def __init__(self, model: Any) -> None:
        self._outer, self._base = id(model), id(ckpt.unwrap(model))
        self.inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.batch: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.for_base = False
        self._handle: Any = None
        self._hooks: Hooks | None = None

    def install(self, hooks: Hooks) -> None:
        from torch.nn.modules.module import register_module_forward_hook

        self._hooks = hooks
        try:
            self._handle = hooks.add(register_module_forward_hook(self._seen, with_kwargs=True))
        except TypeError:  # a torch whose process-wide hooks get no keyword arguments: the synthetic batch serves
            self._handle = None

    def _seen(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        import torch

        key = id(module)
        if key not in (self._outer, self._base) or not (module.training and torch.is_grad_enabled()):
            return
        try:  # the base runs inside the outer wrapper and is seen first; the outer's inputs win
            sample = first_sample(args, kwargs)
        except Exception:  # a plugin bug never stops training
            sample = None
        if sample is not None:
            self.inputs, self.for_base = sample, key != self._outer
            self.batch = (args, {k: v for k, v in kwargs.items() if k != "num_items_in_batch"})
        if key == self._outer:
            self.remove()

    def remove(self) -> None:
        if self._handle is not None:
            self._hooks.discard(self._handle)
            self._handle = None


def synthetic(model: Any, seed: int, length: int) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """`length` token ids (labels for a causal LM, decoder ids for an encoder-decoder); None without ids."""
    import inspect

    import torch

    base = ckpt.unwrap(model)
    if getattr(base, "main_input_name", None) != "input_ids":
        return None
    vocab = int(getattr(getattr(base, "config", None), "vocab_size", 0) or 2)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.randint(vocab, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)
    try:
        accepted = set(inspect.signature(base.forward).parameters)
    except (TypeError, ValueError):
        accepted = {"input_ids"}
    kwargs: dict[str, Any] = {"input_ids": ids}
    if "decoder_input_ids" in accepted and getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = ids[:, : max(length // 2, 1)]
    elif "labels" in accepted and type(base).__name__.endswith("ForCausalLM"):
        kwargs["labels"] = ids
    return (), kwargs


def _scalar(output: Any, seed: int) -> Any:
    """The finite loss (with auxiliary losses such as a router's) plus a fixed random projection of the first output
    that requires grad (the logits), so a model without labels is probed too."""
    import torch

    loss = getattr(output, "loss", None)
    values = list(output.values()) if isinstance(output, dict) else output
    if isinstance(values, torch.Tensor):
        values = [values]
    first = next(
        (
            t
            for t in (values if isinstance(values, (list, tuple)) else [])
            if isinstance(t, torch.Tensor) and t is not loss and t.requires_grad and t.is_floating_point()
        ),
        None,
    )
    total = None
    if isinstance(loss, torch.Tensor) and loss.requires_grad and bool(torch.isfinite(loss.detach()).all()):
        total = loss.float().sum()
    if first is not None:
        gen = torch.Generator().manual_seed(seed + 1)
        weights = torch.randn(first.shape, generator=gen).to(first.device, first.dtype)
        projected = (first * weights).float().sum() / math.sqrt(max(first.numel(), 1))
        total = projected if total is None else total + projected
    return total


def fits(model: Any, tokens: int) -> str | None:
    """On CUDA: why the probe's forward without checkpointing does not fit in the free memory, else None."""
    import torch

    params = list(model.parameters())
    if not params or params[0].device.type != "cuda":
        return None
    config = getattr(ckpt.unwrap(model), "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    largest = max(p.numel() for p in params)
    need = tokens * hidden * layers * 40 + tokens * vocab * 12 + largest * 8 + (64 << 20)
    free, _ = torch.cuda.mem_get_info(params[0].device)
    if free < need:
        return f"its forward needs about {need / 2**30:.2f} GiB and {free / 2**30:.2f} GiB are free"
    return None


def parity_probe(
    model: Any,
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    batch: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    seed: int = 0,
    length: int = 16,
) -> ParityResult:
    """Compare on `inputs` (one sample, `first_sample`), else the whole `batch` (up to `MAX_BATCH_TOKENS`), else a
    synthetic `length`-token sequence; `seed` seeds the batch, the projections and the forward's random ops."""
    import torch

    base = ckpt.unwrap(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        return ParityResult(skipped="no trainable parameters")
    flagged = [m for m in base.modules() if getattr(m, ckpt.FLAG, None) is True]
    if not flagged:
        return ParityResult(skipped="no module checkpoints")
    low = any(p.dtype in (torch.float16, torch.bfloat16) for _, p in params)
    result = ParityResult(rtol=LOW_PRECISION_RTOL if low else PARITY_RTOL)
    device = params[0][1].device
    candidates = []
    if inputs is not None:
        candidates.append(("first training batch", _to(inputs, device)))
    if batch is not None and _tokens(*batch) <= MAX_BATCH_TOKENS:
        candidates.append(("whole first training batch", _to(batch, device)))
    made = synthetic(model, seed, length)
    if made is not None:
        candidates.append(("synthetic", made))
    if not candidates:
        result.skipped = (
            "no batch: the first training forward was not seen and main_input_name is "
            f"{getattr(base, 'main_input_name', None)!r}"
        )
        return result
    failures = []
    for origin, (f_args, f_kwargs) in candidates:
        tokens = _tokens(f_args, f_kwargs)
        too_big = fits(model, tokens)
        if too_big:
            failures.append(f"{origin}: {too_big}")
            continue
        try:
            with_gc, without = _passes(model, params, flagged, f_args, f_kwargs, seed)
        except Exception as exc:  # this batch does not run here (a forward that wants more than token ids)
            failures.append(f"{origin}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if not without:
            failures.append(f"{origin}: the forward gives nothing to differentiate")
            continue
        result.batch = f"{origin}, {tokens} token(s)"
        _compare(result, params, with_gc, without)
        return result
    result.skipped = "; ".join(failures)
    return result


def _passes(
    model: Any, params: list[tuple[str, Any]], flagged: list[Any], args: Any, kwargs: Any, seed: int
) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    import torch

    saved_grads = [p.grad for _, p in params]
    base = ckpt.unwrap(model)
    buffers = [(b, b.detach().clone()) for b in base.buffers()]
    counters = [  # public number attributes (a step counter a forward advances)
        (module, name, value)
        for module in base.modules()
        for name, value in vars(module).items()
        if not name.startswith("_") and isinstance(value, numbers.Number) and not isinstance(value, bool)
    ]
    was_training = model.training
    device = params[0][1].device
    devices = [device] if device.type == "cuda" else []
    saved = ckpt.snapshot(base, functions=False)

    def put_back_state() -> None:
        with torch.no_grad():
            for buffer, copy in buffers:
                buffer.copy_(copy)
        for module, name, value in counters:
            setattr(module, name, value)

    def run(checkpointing: bool) -> dict[int, list[float]]:
        put_back_state()  # both passes start from the run's state (a counter the forward advances, running stats)
        for m in flagged:
            ckpt.set_flag(m, checkpointing)
        prints = Fingerprints(params, seed)
        with torch.random.fork_rng(devices=devices), fingerprinting(prints):
            torch.manual_seed(seed)
            scalar = _scalar(model(*args, **kwargs), seed)
            if scalar is not None:  # None: nothing requires grad (reentrant with frozen inputs): no gradient at all
                scalar.backward()
        return prints.values()

    try:
        for _, p in params:
            p.grad = None
        model.train()
        with_gc = run(True)
        without = run(False)
    finally:
        ckpt.restore(saved)
        for (_, p), g in zip(params, saved_grads, strict=True):
            p.grad = g
        put_back_state()
        model.train(was_training)
    return with_gc, without


def _compare(
    result: ParityResult,
    params: list[tuple[str, Any]],
    with_gc: dict[int, list[float]],
    without: dict[int, list[float]],
) -> None:
    def size(v: list[float]) -> float:
        return math.sqrt(sum(x * x for x in v) / len(v))

    sizes = {i: size(v) for i, v in without.items()}
    scale = max(sizes.values(), default=0.0)
    deviations = []
    for index, ref in without.items():
        name, ref_size = params[index][0], sizes[index]
        if ref_size == 0.0:
            continue
        got = with_gc.get(index)
        if got is None or size(got) == 0.0:
            result.missing_with_checkpointing.append(name)
            continue
        diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
        result.compared += 1
        result.max_abs = max(result.max_abs, diff)
        result.max_rel = max(result.max_rel, diff / ref_size)
        if diff > result.rtol * max(ref_size, FLOOR * scale):
            deviations.append((diff / ref_size, name))
    result.outside = [name for _, name in sorted(deviations, reverse=True)]
    _major(result, params, with_gc, without)


def _major(
    result: ParityResult,
    params: list[tuple[str, Any]],
    with_gc: dict[int, list[float]],
    without: dict[int, list[float]],
) -> None:
    """The relative L2 differences (the projections keep norms in expectation) of the gradients that are not
    negligible, and which of them differ by more than `FAR`."""

    def norm(v: list[float]) -> float:
        return math.sqrt(sum(x * x for x in v))

    sizes = {i: norm(v) for i, v in without.items()}
    scale = max(sizes.values(), default=0.0)
    far = []
    for index, ref in without.items():
        if sizes[index] == 0.0 or sizes[index] < MAJOR * scale:
            continue
        got = with_gc.get(index) or [0.0] * len(ref)
        rel = norm([a - b for a, b in zip(got, ref, strict=True)]) / sizes[index]
        result.major_rel = max(result.major_rel, rel)
        if rel > FAR:
            far.append((rel, params[index][0]))
    result.major = [name for _, name in sorted(far, reverse=True)]


def _tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    import torch

    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0] * value.shape[1])
    return 1


def _to(inputs: tuple[tuple[Any, ...], dict[str, Any]], device: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    args, kwargs = inputs
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
