"""`trl-gc-plan CONFIG_OR_LAYOUT --batch-size B --seq-len S --budget 40GiB`: plan checkpointing for a full fine-tune
of a model config (`config.json`, a directory holding one, or a named layout), estimated on fake tensors. For LoRA or a
partly frozen model, plan from the live model (`memory.estimate(model, ...)`).

Exit status: 0 a plan fits, 1 nothing fits (the lowest-memory plan is printed), 2 unreadable input or an invalid
option (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from ..core.errors import UsageError

# Published layouts (model cards / config.json of the released checkpoints).
_LLAMA2 = {"vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
_LLAMA3 = {"vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _layout(base: dict[str, Any], *sizes: int, **extra: Any) -> dict[str, Any]:
    return {**base, **dict(zip(_SIZES, sizes, strict=True)), **extra}


LAYOUTS: dict[str, dict[str, Any]] = {
    "llama-7b": _layout(_LLAMA2, 4096, 11008, 32, 32, 32),
    "llama-13b": _layout(_LLAMA2, 5120, 13824, 40, 40, 40),
    "llama-70b": _layout(_LLAMA2, 8192, 28672, 80, 64, 8),
    "llama3-1b": _layout(_LLAMA3, 2048, 8192, 16, 32, 8, tie_word_embeddings=True),
    "llama3-8b": _layout(_LLAMA3, 4096, 14336, 32, 32, 8),
    "llama3-70b": _layout(_LLAMA3, 8192, 28672, 80, 64, 8),
}
ALIASES = {"llama2-7b": "llama-7b", "llama2-13b": "llama-13b", "llama2-70b": "llama-70b", "llama3.2-1b": "llama3-1b"}
_POSITIVE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
MAX_TOKENS = 2**26  # batch x sequence: far above any single device's step; keeps the fake forward's shapes sane


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage block
        raise UsageError(message)


def _parser() -> _Parser:
    from ..planning.planner import SHARDED_LAYOUTS

    parser = _Parser(
        prog="trl-gc-plan",
        description="Plan the cheapest gradient checkpointing that fits an activation-memory budget.",
        epilog=f"named layouts: {', '.join(sorted(LAYOUTS))}. Budget: a number of bytes or 40GiB, 512MiB, 1.5GB.",
    )
    parser.add_argument("model", metavar="CONFIG_OR_LAYOUT", help="config.json, a directory holding one, or a layout")
    parser.add_argument("--batch-size", type=int, required=True, help="sequences per device and step")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--budget", required=True, help="activation memory per device, e.g. 40GiB")
    parser.add_argument("--dtype", default=None, help="bf16 (default unless the config names one), fp16, fp32")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    parser.add_argument("--reentrant", action="store_true", help="the run uses use_reentrant=True (no selective)")
    parser.add_argument("--accelerator", action="store_true", help="the run has an accelerator (offload allowed)")
    parser.add_argument(
        "--grad-shards",
        type=int,
        default=None,
        metavar="N",
        help="parameter gradients sharded over N devices (ZeRO-2/3, FSDP); default 1, or what --accelerate-config says",
    )
    parser.add_argument(
        "--sharded-params",
        choices=SHARDED_LAYOUTS,
        default=None,
        help="the parameters are sharded too: count those held whole while a block or the head computes, as the run "
        "does (ZeRO-3 with DeepSpeed's default reuse distance and prefetch bucket; FSDP with accelerate's wrapping; "
        "fsdp1-shard-grad-op / fsdp2-no-reshard: transformers' fsdp='shard_grad_op', every unit whole until its "
        "backward)",
    )
    parser.add_argument(
        "--deepspeed",
        default=None,
        metavar="CONFIG",
        help="the run's DeepSpeed JSON config: under ZeRO-3 its parameters are sharded, with its reuse distance and "
        "prefetch bucket (read as the run reads them)",
    )
    parser.add_argument(
        "--accelerate-config",
        default=None,
        metavar="FILE",
        help="the run's accelerate config (accelerate launch --config_file): the sharding and the gradient shards it "
        "gives (DeepSpeed ZeRO-2/3, FSDP1's fsdp_sharding_strategy, FSDP2's fsdp_reshard_after_forward, over "
        "num_processes / num_machines for hybrid sharding), read as trl-gc-check reads it",
    )
    parser.add_argument(
        "--effective-batch",
        type=int,
        default=None,
        metavar="N",
        help="rows per device per optimizer step: rank micro-batch x accumulation x plan by predicted tokens/s "
        "(micro-batches up to --batch-size that divide N)",
    )
    parser.add_argument("--all", action="store_true", help="list every candidate (default: the main ones)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw the candidates (predicted peak against recompute, the budget line, the pick) to FILE (.png, "
        ".svg); needs matplotlib (pip install 'trl-gc-plugin[plot]')",
    )
    return parser


def _read_json(path: str) -> dict[str, Any]:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise UsageError(f"{file}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{file}: not a UTF-8 text file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{file}: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise UsageError(f"{file}: nested too deeply") from None
    if not isinstance(data, dict):
        raise UsageError(f"{file}: the top level must be a JSON object, not {type(data).__name__}")
    return data


def load_config(source: str) -> tuple[Any, str]:
    """A `PretrainedConfig` from a layout name or a config.json path, and a label for it."""
    name = ALIASES.get(source.lower(), source.lower())
    if name in LAYOUTS and not os.path.exists(source):
        from transformers import LlamaConfig

        return LlamaConfig(**LAYOUTS[name], use_cache=False), name
    if not os.path.exists(source):
        raise UsageError(f"{source}: no such file, directory or layout (layouts: {', '.join(sorted(LAYOUTS))})")
    data = _read_json(source)
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(f"{source}: key 'model_type': expected a model type such as \"llama\", got {model_type!r}")
    for key in _POSITIVE:
        value = data.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UsageError(f"{source}: key {key!r}: expected a positive integer, got {value!r}")
    hidden, heads = data.get("hidden_size"), data.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and data.get("head_dim") is None and hidden % heads:
        raise UsageError(
            f"{source}: key 'num_attention_heads': hidden_size {hidden} is not a multiple of {heads} "
            "(give head_dim when the heads are not hidden_size / num_attention_heads wide)"
        )
    layers = data.get("num_hidden_layers")
    if isinstance(layers, int) and layers > 4096:
        raise UsageError(f"{source}: key 'num_hidden_layers': {layers} is not a plausible layer count")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise UsageError(f"{source}: key 'model_type': unknown model type {model_type!r}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{source}: key 'model_type': {model_type!r} has no causal language model to plan for")
    rest = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **rest)
    except Exception as exc:
        raise UsageError(f"{source}: {_one_line(exc)}") from None
    return config, source


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Each column padded to its widest cell, the last one as it is."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(x.ljust(w) for x, w in zip(r[:-1], widths, strict=True)), r[-1]]) for r in rows]


def render(plan: Any, label: str, show_all: bool = False) -> str:
    """The candidate table and the pick, as text."""
    from ..core.units import format_bytes

    e = plan.estimate
    head = (
        f"{label}: {e['blocks']} blocks, batch {e['batch_size']} x {e['seq_len']} tokens, {e['dtype']}, "
        f"{e['attn_implementation']} attention; budget {format_bytes(plan.budget)} (activations, gradients and "
        "loss buffers above the weights and optimizer state)"
    )
    if e.get("grad_fraction", 1.0) != 1.0 or e.get("gathered_bytes"):
        head += (
            f"; {e.get('grad_fraction', 1.0):.3g} of the gradients on this device, "
            f"{format_bytes(e.get('gathered_bytes', 0))} of parameters held whole (sharded)"
        )
    rows = [("candidate", "blocks", "saved", "peak", "peak at", "recompute", "fits", "")]
    keep = {"none", "full", "selective", "selective-lean", "offload", "mixed"}
    for c in plan.candidates:
        main = c.name in keep or (c.layout.every_n is not None and c.layout.every_n <= 8)
        if not (show_all or main or c is plan.chosen or c is plan.lowest):
            continue
        fits = ("yes" if c.peak_bytes <= plan.budget else "no") if c.allowed else "-"
        note = c.why_not if not c.allowed else ("<- plan" if c is plan.chosen else "")
        blocks = f"{c.layout.checkpointed}/{len(c.layout)}"
        saved, peak = format_bytes(c.saved_bytes), format_bytes(c.peak_bytes)
        rows.append((c.name, blocks, saved, peak, c.peak_at, f"{c.recompute:.0%}", fits, note))
    lines = [head, "", *_table(rows), ""]
    if plan.chosen is not None:
        lines.append(f"plan: {plan.chosen.summary()}, predicted peak {format_bytes(plan.chosen.peak_bytes)}")
    else:
        c = plan.lowest
        lines.append(
            f"nothing fits: the lowest-memory plan, {c.summary()}, needs {format_bytes(c.peak_bytes)} "
            f"(budget {format_bytes(plan.budget)})"
        )
    return "\n".join(lines)


_FSDP_LAYOUTS = {
    (1, "FULL_SHARD"): ("fsdp1", False),
    (1, "SHARD_GRAD_OP"): ("fsdp1-shard-grad-op", False),
    (1, "HYBRID_SHARD"): ("fsdp1", True),
    (1, "HYBRID_SHARD_ZERO2"): ("fsdp1-shard-grad-op", True),
    (2, "FULL_SHARD"): ("fsdp2", False),
    (2, "SHARD_GRAD_OP"): ("fsdp2-no-reshard", False),
}
# (FSDP version, sharding) -> (layout, sharded within a machine only); any other (NO_SHARD): nothing sharded


def _accelerate_sharding(file: str) -> tuple[str | None, int | None, str]:
    """(layout, gradient shards or None when the file gives no process count, what it was read from) of an accelerate
    config, read as `trl-gc-check` reads it."""
    from ..configcheck.read.accelerate import read_accelerate
    from ..configcheck.read.common import ConfigError

    try:
        accel = read_accelerate(file)
    except (ConfigError, OSError) as exc:
        raise UsageError(f"--accelerate-config {file}: {_one_line(exc)}") from None
    procs = accel.num_processes
    if accel.zero_stage is not None:
        what = f"DeepSpeed ZeRO-{accel.zero_stage}"
        return ("zero3" if accel.zero_stage == 3 else None), (procs if accel.zero_stage >= 2 else 1), what
    if accel.fsdp and accel.fsdp_version in (1, 2) and accel.fsdp_sharding is not None:
        layout, hybrid = _FSDP_LAYOUTS.get((accel.fsdp_version, accel.fsdp_sharding), (None, None))
        what = f"FSDP{accel.fsdp_version} {accel.fsdp_sharding}"
        if layout is None:
            return None, 1, what
        shards = procs // accel.num_machines if hybrid and procs is not None else procs
        return layout, shards, what
    return None, 1, accel.distributed_type


def _sharding(ns: argparse.Namespace) -> tuple[str | None, int, int]:
    """The parameter sharding to plan for, ZeRO-3's window (elements) and the gradient shards, from the options or the
    configs they name (an explicit option that disagrees with a config is refused)."""
    from ..core.deepspeed_config import ZERO3_WINDOW_DEFAULTS

    layout, window = _deepspeed_sharding(ns) if ns.deepspeed is not None else (ns.sharded_params, None)
    window = sum(ZERO3_WINDOW_DEFAULTS.values()) if window is None else window
    shards = ns.grad_shards
    if ns.accelerate_config is not None:
        read, read_shards, what = _accelerate_sharding(ns.accelerate_config)
        if (ns.deepspeed is not None or ns.sharded_params is not None) and layout != read:
            option = "--deepspeed" if ns.deepspeed is not None else f"--sharded-params {layout}"
            raise UsageError(f"{option} disagrees with --accelerate-config {ns.accelerate_config} ({what})")
        if read_shards is None and shards is None:
            raise UsageError(
                f"--accelerate-config {ns.accelerate_config}: {what} shards over num_processes, which the file does "
                "not give: give --grad-shards"
            )
        if shards is not None and read_shards is not None and shards != read_shards:
            raise UsageError(
                f"--grad-shards {shards} disagrees with --accelerate-config {ns.accelerate_config} ({what} over "
                f"{read_shards} devices)"
            )
        layout, shards = read, (shards if read_shards is None else read_shards)
    return layout, window, 1 if shards is None else shards


def _deepspeed_sharding(ns: argparse.Namespace) -> tuple[str | None, int]:
    from ..core.deepspeed_config import deepspeed_facts

    try:
        with open(ns.deepspeed, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--deepspeed {ns.deepspeed}: {_one_line(exc)}") from None
    if not isinstance(config, dict):
        raise UsageError(f"--deepspeed {ns.deepspeed}: expected a JSON object")
    facts = deepspeed_facts(config)
    if facts.problems:
        raise UsageError(f"--deepspeed {ns.deepspeed}: {facts.problems[0]}")
    layout = "zero3" if facts.stage == 3 else None
    if ns.sharded_params not in (None, layout):
        raise UsageError(
            f"--sharded-params {ns.sharded_params} disagrees with --deepspeed {ns.deepspeed} (ZeRO stage {facts.stage})"
        )
    return layout, facts.gather_window


def run(argv: list[str] | None) -> tuple[int, str]:
    """Parse, estimate, plan. Returns (exit status, stdout text); raises `UsageError` for exit status 2."""
    ns = _parser().parse_args(argv)
    from ..core.units import parse_size
    from ..planning.memory import _dtype_of, config_dtype, estimate
    from ..planning.planner import layout_gathered, plan

    try:
        budget = parse_size(ns.budget)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if ns.batch_size < 1 or ns.seq_len < 1:
        raise UsageError("--batch-size and --seq-len must be positive integers")
    if ns.grad_shards is not None and ns.grad_shards < 1:
        raise UsageError("--grad-shards must be a positive integer")
    if ns.batch_size * ns.seq_len > MAX_TOKENS:
        raise UsageError(f"--batch-size x --seq-len must be at most {MAX_TOKENS} tokens")
    layout, window, shards = _sharding(ns)
    config, label = load_config(ns.model)
    try:
        dtype = _dtype_of(ns.dtype if ns.dtype is not None else config_dtype(config) or "bf16")
    except ValueError as exc:
        raise UsageError(f"--dtype: {exc}") from None

    def estimate_at(mb: int) -> Any:
        est = estimate(config, mb, ns.seq_len, dtype=dtype, attn_implementation=ns.attn)
        return est if layout is None else dataclasses.replace(est, gathered_bytes=layout_gathered(est, layout, window))

    try:
        est = estimate_at(ns.batch_size)
    except Exception as exc:
        raise UsageError(f"{label}: cannot run the model's layout: {type(exc).__name__}: {_one_line(exc)}") from None
    common = {"allow_selective": not ns.reentrant, "allow_offload": ns.accelerator, "grad_fraction": 1.0 / shards}
    result = plan(est, budget, **common)
    options = None
    if ns.effective_batch is not None:
        if ns.effective_batch < 1:
            raise UsageError("--effective-batch must be a positive integer")
        from ..planning.throughput import rank

        options = rank(
            lambda mb: est if mb == ns.batch_size else estimate_at(mb),
            ns.effective_batch,
            budget,
            device="cuda" if ns.accelerator else "cpu",
            largest=ns.batch_size,
            **common,
        )
    if ns.json:
        data = {"model": label, **result.to_dict()}
        if options is not None:
            data["throughput"] = [o.to_dict() for o in options]
        text = json.dumps(data, indent=2)
    else:
        text = render(result, label, ns.all)
        if options is not None:
            text += "\n\n" + render_throughput(options, ns.effective_batch, ns.batch_size)
    if ns.plot:
        from .plot import plot

        try:
            plot(result, label, ns.plot)
        except UsageError:  # matplotlib is not installed: its own line
            raise
        except (OSError, ValueError) as exc:
            raise UsageError(f"--plot {ns.plot}: {type(exc).__name__}: {_one_line(exc)}") from None
        text += f"\n\nplot: {ns.plot}" if not ns.json else ""
    fits = options[0].fits if options else result.fits
    return (0 if fits else 1), text


def render_throughput(options: list[Any], effective: int, batch_size: int) -> str:
    """The (micro-batch, accumulation, plan) options, fastest first, and the advice."""
    from ..core.units import format_bytes

    lines = [f"effective batch {effective} rows per device, ranked by predicted tokens/s (relative to the fastest):"]
    rows = [("micro-batch", "accumulation", "plan", "peak", "speed")]
    for o in options:
        plan_text = o.plan.summary() if o.plan is not None else "nothing fits"
        peak = format_bytes(o.plan.peak_bytes) if o.plan is not None else "-"
        rows.append((str(o.micro_batch), str(o.accumulation), plan_text, peak, f"{o.relative_speed:.2f}"))
    lines += _table(rows)
    pick = options[0]
    if not pick.fits:
        lines.append("nothing fits at any micro-batch: raise the budget or shorten the sequences")
        return "\n".join(lines)
    given = next((o for o in options if o.micro_batch == batch_size), None)
    versus = (
        f", {1 / given.relative_speed:.2f}x the predicted speed of micro-batch {batch_size}"
        if given is not None and given.fits and given is not pick
        else ""
    )
    lines.append(
        f"pick: {pick.summary()}{versus}. The plugin applies the checkpointing plan only: set "
        f"per_device_train_batch_size={pick.micro_batch} and gradient_accumulation_steps={pick.accumulation} yourself."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The `trl-gc-plan` command. Exit 0: a plan fits; 1: nothing fits; 2: unreadable input or invalid option."""
    import logging
    import warnings

    previous = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code, text = run(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        sys.stderr.write(f"trl-gc-plan: error: {_one_line(exc)}\n")
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except Exception as exc:  # never a traceback
        sys.stderr.write(f"trl-gc-plan: error: {type(exc).__name__}: {_one_line(exc)}\n")
        return 2
    finally:
        logging.getLogger("transformers").setLevel(previous)
    sys.stdout.write(text + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
