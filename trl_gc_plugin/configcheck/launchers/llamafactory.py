"""LLaMA-Factory v0 YAML configs (`llamafactory-cli train cfg.yaml`): the plugin's model of main@ff6d4d12 (= PyPI
0.9.5 here), or its own `get_train_args` when importable (`read_native`). It checkpoints the model itself, before the
adapter; its wrapper makes trainable layers' hidden states require grad, so reentrant trains with frozen embeddings.
`parse_dict` converts nothing: a quoted `"false"` is true.
"""

from __future__ import annotations

from typing import Any

from ..read.accelerate import read_accelerate, set_accelerate_facts
from ..read.common import (
    ConfigError,
    Context,
    Fact,
    LauncherRule,
    Origin,
    Reading,
    Reentrant,
    find_beside,
    json_object_or_mapping,
    release,
    short,
    type_name,
    where,
)
from ..read.deepspeed import read_deepspeed
from ..read.load import Config, load_json_file
from ..read.model_config import read_model_facts
from ..read.native import importable
from .base import Launcher
from .schema import Key, Step, Values, as_given, checked, read_keys, rewrite
from .trl import read_fsdp_config, set_fsdp_facts

COMMIT = "ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30"
VERSION_MODELLED = "LLaMA-Factory main@ff6d4d12 (= 0.9.5 for these keys)"
SRC = f"https://github.com/hiyouga/LLaMA-Factory/blob/{COMMIT}/src/llamafactory/"

SOURCES = {
    "keys": (
        f"{SRC}hparams/model_args.py#L129-L152 (use_unsloth, use_unsloth_gc, disable_gradient_checkpointing, "
        "use_reentrant_gc)"
    ),
    "enable": (
        f"{SRC}model/model_utils/checkpointing.py#L163-L204 (prepare_model_for_training: FSDP2 -> use_reentrant_gc "
        f"False; {{use_reentrant: use_reentrant_gc}}; use_cache False)"
    ),
    "wrapper": (
        f"{SRC}model/model_utils/checkpointing.py#L100-L154 (hidden states require grad for trainable layers; no "
        "kwargs -> use_reentrant True)"
    ),
    "trainable": f"{SRC}model/patcher.py#L476-L483 (only a trainable model (do_train) gets checkpointing)",
    "parse_dict": (
        "https://github.com/huggingface/transformers/blob/v5.8.0/src/transformers/hf_argparser.py (parse_dict: "
        "dataclass(**values), no string conversion)"
    ),
    "verify": (
        f"{SRC}hparams/parser.py#L227-L237 (_verify_model_args: adapters only with LoRA, quantization only with "
        "LoRA/OFT)"
    ),
    "ddp": f"{SRC}hparams/parser.py#L596-L602 (DDP + LoRA: ddp_find_unused_parameters False)",
    "deepspeed": f"{SRC}hparams/parser.py#L471-L472 (DeepSpeed needs a distributed launch (FORCE_TORCHRUN=1))",
    "versions": f"{SRC}extras/misc.py#L95-L101 (check_dependencies: transformers>=4.55.0,<=5.8.0)",
    "hyper_parallel": (
        f"{SRC}train/hyper_parallel/workflow.py#L41-L59 (_prepare_hp_args: activation_mode != 'none' -> "
        "disable_gradient_checkpointing = True)"
    ),
    "hyper_parallel_stages": f"{SRC}train/tuner.py#L92-L101 (use_hyper_parallel runs the pt and sft stages only)",
    "hyper_parallel_modes": "https://github.com/hiyouga/LlamaFactory/pull/10370 (activation_mode none (default) / "
    "recompute / swap; recompute and swap disable native gradient_checkpointing)",
}

MARKERS = frozenset(
    {
        "stage",
        "finetuning_type",
        "template",
        "cutoff_len",
        "lora_rank",
        "lora_target",
        "quantization_bit",
        "quantization_method",
        "disable_gradient_checkpointing",
        "use_reentrant_gc",
        "use_unsloth_gc",
        "freeze_trainable_layers",
        "freeze_trainable_modules",
        "pref_loss",
        "export_dir",
        "infer_backend",
        "adapter_name_or_path",
        "dataset_dir",
        "use_hyper_parallel",
        "hyper_parallel_args",
    }
)
"""Keys only LLaMA-Factory's configs use."""

STRONG_MARKERS = frozenset({"stage", "finetuning_type", "template", "cutoff_len"})

STAGES = {"pt": "trainer", "sft": "sft", "rm": "reward", "ppo": "ppo", "dpo": "dpo", "kto": "kto"}
"""`stage` and the trainer kind it runs (pt/sft: LLaMA-Factory's Trainer subclasses; dpo/kto/ppo: TRL's)."""

FINETUNING_TYPES = ("lora", "oft", "freeze", "full")

BUNDLED_DEEPSPEED = {
    "ds_z0_config.json": 0,
    "ds_z2_config.json": 2,
    "ds_z2_autotp_config.json": 2,
    "ds_z2_offload_config.json": 2,
    "ds_z3_config.json": 3,
    "ds_z3_fp8_config.json": 3,
    "ds_z3_offload_config.json": 3,
}
"""LLaMA-Factory's `examples/deepspeed/` configs, with their ZeRO stages."""

SUPPORTED_TRANSFORMERS = ((4, 55), (5, 8))


_STRING = checked(lambda v: isinstance(v, str), "expected a string, got {type} {value}")
_STAGE = checked(lambda v: v in STAGES, f"not one of LLaMA-Factory's stages ({', '.join(STAGES)}): {{value}}")
_FINETUNING = checked(
    lambda v: v in FINETUNING_TYPES, f"LLaMA-Factory asserts one of {', '.join(FINETUNING_TYPES)}, got {{value}}"
)
_BITS = checked(
    lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    "expected a whole number such as 4 or 8, got {type} {value}",
)
KEYS = (  # what LLaMA-Factory's argument dataclasses check, in the plugin's order: the strings, then their choices
    Key("stage", ("stage",), _STRING, "sft"),
    Key("finetuning_type", ("finetuning_type",), _STRING, "lora"),
    Key("method", ("quantization_method",), _STRING, "bnb"),
    Key("stage", ("stage",), _STAGE, "sft"),
    Key("finetuning_type", ("finetuning_type",), _FINETUNING, "lora"),
    Key("quantization_bit", ("quantization_bit",), _BITS),
)
FLAGS = (  # the boolean fields read: kept as given (parse_dict converts nothing), each use tests them for truth
    Key("disabled", ("disable_gradient_checkpointing",), as_given, False),
    Key("reentrant", ("use_reentrant_gc",), as_given, True),
    Key("unsloth_gc", ("use_unsloth_gc",), as_given, False),
    Key("unsloth", ("use_unsloth",), as_given, False),
    Key("do_train", ("do_train",), as_given, False),
    Key("hf_gc", ("gradient_checkpointing",), as_given, False),
    Key("hyper", ("use_hyper_parallel",), as_given, False),
    Key("kt", ("use_kt",), as_given, False),
)

READ_KEYS = frozenset(
    {
        *(name for key in (*KEYS, *FLAGS) for name in key.names),
        *("model_name_or_path", "dataset", "output_dir", "export_dir", "adapter_name_or_path"),
        *("gradient_checkpointing_kwargs", "deepspeed", "fsdp", "fsdp_config", "ddp_find_unused_parameters"),
        *("ddp_static_graph", "hyper_parallel_args"),
    }
)

REENTRANT_GC = (  # use_reentrant_gc (the file's or its default), then FSDP2's
    Step(lambda k, _: k.reentrant_name is not None, lambda k: k.reentrant, "key 'use_reentrant_gc'", "file"),
    Step(
        lambda k, _: k.reentrant_name is None,
        True,
        "use_reentrant_gc defaults to true ({src[keys]})",
        "launcher default",
    ),
    Step(lambda k, _: k.fsdp2, False, "FSDP2: LLaMA-Factory sets use_reentrant_gc false ({src[enable]})"),
)
REENABLE = (  # `gradient_checkpointing: true`: the Trainer re-enables through LLaMA-Factory's method; then Unsloth's
    Step(
        lambda k, _: k.reenable and (k.kwargs or {}).get("use_reentrant") is not None,
        lambda k: k.kwargs["use_reentrant"],
        "key 'gradient_checkpointing_kwargs.use_reentrant' (the Trainer re-enables with it)",
        "file",
    ),
    Step(
        lambda k, _: k.reenable and k.kwargs is None,
        True,
        "gradient_checkpointing: true without kwargs: the Trainer re-enables through LLaMA-Factory's method with "
        "{{use_reentrant: true}} ({src[wrapper]})",
    ),
    Step(
        lambda k, _: k.unsloth_gc,
        True,
        "use_unsloth_gc: an autograd Function that recomputes reentrant-style whatever use_reentrant says",
    ),
)


RULES: tuple[LauncherRule, ...] = (
    LauncherRule(
        id="llamafactory:quantization-needs-adapter",
        action="error",
        setting="quantization_bit",
        condition="`quantization_bit` with `finetuning_type` freeze or full",
        message='LLaMA-Factory refuses to start: "Quantization is only compatible with the LoRA or OFT method."',
        change="finetuning_type: lora (or remove quantization_bit)",
        evidence=(SOURCES["verify"],),
        when=lambda v: v.quantization_bit is not None and v.finetuning_type not in ("lora", "oft"),
    ),
    LauncherRule(
        id="llamafactory:adapter-needs-lora",
        action="error",
        setting="adapter_name_or_path",
        condition="`adapter_name_or_path` with `finetuning_type` other than lora",
        message='LLaMA-Factory refuses to start: "Adapter is only valid for the LoRA method."',
        change="finetuning_type: lora (or remove adapter_name_or_path)",
        evidence=(SOURCES["verify"],),
        when=lambda v: v.raw.get("adapter_name_or_path") is not None and v.finetuning_type != "lora",
    ),
    LauncherRule(
        id="llamafactory:string-boolean",
        action="warn",
        setting="quoted booleans",
        condition='a boolean key written as a string (`disable_gradient_checkpointing: "false"`)',
        message=(
            "LLaMA-Factory builds its arguments with parse_dict, which converts no string, and tests the value for "
            'truth: any non-empty string means true (`disable_gradient_checkpointing: "false"` turns checkpointing '
            'off, `use_reentrant_gc: "false"` stays reentrant).'
        ),
        change="write YAML booleans (true / false, unquoted)",
        evidence=(SOURCES["parse_dict"], SOURCES["enable"]),
        when=lambda v: bool(v.string_bools),
    ),
    LauncherRule(
        id="llamafactory:reentrant-default",
        action="none",
        setting="use_reentrant",
        condition="checkpointing on and `use_reentrant_gc` not set",
        message=(
            "LLaMA-Factory checkpoints reentrant by default (use_reentrant_gc: true) and makes the hidden states "
            "require grad for every layer with trainable parameters, so reentrant trains with frozen embeddings."
        ),
        evidence=(SOURCES["keys"], SOURCES["wrapper"]),
        when=lambda v: v.reentrant_default,
        disagreement=(
            "the plugin prefers non-reentrant (PyTorch's recommendation) but keeps the launcher's value; set "
            "`use_reentrant_gc: false` to follow it."
        ),
    ),
    LauncherRule(
        id="llamafactory:trainer-gc-overrides",
        action="warn",
        setting="use_reentrant",
        condition=(
            "`gradient_checkpointing: true` without `gradient_checkpointing_kwargs`, and `use_reentrant_gc: false`"
        ),
        message=(
            "The Trainer re-enables checkpointing through LLaMA-Factory's patched method, which without kwargs uses "
            "{use_reentrant: true}: your use_reentrant_gc: false does not hold."
        ),
        change="also set gradient_checkpointing_kwargs: {use_reentrant: false}, or drop gradient_checkpointing: true",
        evidence=(SOURCES["wrapper"],),
        when=lambda v: v.hf_gc_overrides,
    ),
    LauncherRule(
        id="llamafactory:hyper-parallel-owns-checkpointing",
        action="none",
        setting="use_hyper_parallel",
        condition="`use_hyper_parallel: true` (stage pt or sft) and `hyper_parallel_args` sets `activation_mode` "
        "recompute or swap",
        message=(
            "HyperParallel checkpoints (or swaps) activations itself, and LLaMA-Factory switches transformers' "
            "checkpointing off for it (disable_gradient_checkpointing): use_reentrant and the plugin's checkpointing "
            "rules do not apply, and the plugin stands back. HyperParallel's own recompute is not modelled."
        ),
        evidence=(SOURCES["hyper_parallel"], SOURCES["hyper_parallel_modes"]),
        when=lambda v: v.hyper_parallel in ("recompute", "swap"),
    ),
    LauncherRule(
        id="llamafactory:hyper-parallel-args-unread",
        action="warn",
        setting="hyper_parallel_args",
        condition="`use_hyper_parallel: true` (stage pt or sft) and the `hyper_parallel_args` file is not found here",
        message=(
            "The check could not read HyperParallel's JSON, so whether HyperParallel replaces transformers' "
            "checkpointing (its activation_mode) is unknown: the verdicts below assume it does not (activation_mode "
            "none), which holds only if the file says so."
        ),
        change="run the check where hyper_parallel_args resolves (the directory you launch from)",
        evidence=(SOURCES["hyper_parallel"],),
        when=lambda v: v.hyper_parallel == "unread",
    ),
    LauncherRule(
        id="llamafactory:fsdp2-non-reentrant",
        action="none",
        setting="use_reentrant",
        condition="FSDP2 (accelerate config with fsdp_version 2)",
        message="LLaMA-Factory sets use_reentrant_gc to false under FSDP2.",
        evidence=(SOURCES["enable"],),
        when=lambda v: v.fsdp2,
    ),
    LauncherRule(
        id="llamafactory:transformers-range",
        action="warn",
        setting="transformers",
        condition="the transformers release checked for is outside LLaMA-Factory's supported range",
        message=(
            "LLaMA-Factory refuses to import with transformers outside >=4.55,<=5.8 unless DISABLE_VERSION_CHECK=1; "
            "outside that range its checkpointing patch is untested."
        ),
        evidence=(SOURCES["versions"],),
        when=lambda v: v.transformers_outside,
    ),
    LauncherRule(
        id="llamafactory:deepspeed-needs-torchrun",
        action="none",
        setting="deepspeed",
        condition="`deepspeed` with one process",
        message=(
            "LLaMA-Factory runs DeepSpeed only in a distributed launch: with one GPU, launch with FORCE_TORCHRUN=1."
        ),
        evidence=(SOURCES["deepspeed"],),
        when=lambda v: v.deepspeed_one_process,
    ),
)


def is_training_config(config: Config) -> bool:
    """A training config (not a chat/API or export config)."""
    if "export_dir" in config:
        return False
    return any(k in config for k in ("stage", "do_train", "output_dir", "dataset"))


def read(config: Config, ctx: Context) -> Reading:
    """The plugin's model of how LLaMA-Factory reads `config` (see the module docstring)."""
    reading = Reading(
        format="llamafactory",
        parser=f"the plugin's model of {VERSION_MODELLED}",
        changes={
            "use_reentrant": "use_reentrant_gc: {value}",
            "activation_checkpointing": "disable_gradient_checkpointing: {not_value}",
        },
    )
    if ctx.trainer is not None:
        reading.notes.append(f"--trainer {ctx.trainer} is ignored: a LLaMA-Factory config says its stage itself")
    k = read_keys(config, (*KEYS, *FLAGS), raw=dict(config.values), kwargs=None, src=SOURCES)
    if not is_training_config(config):  # a chat / API / export config
        reading.training = False
        what = "an export (merge) config" if "export_dir" in config else "a chat / API / inference config"
        reading.set("gc_enabled", False, "file", f"{what}: no stage, do_train, output_dir or dataset; nothing trains")
        reading.notes.append(f"{config.path} is {what}: nothing trains, so checkpointing does not apply")
        return reading
    # checkpointing on/off: LLaMA-Factory's own, on the model, only for a trainable model
    given = k.disabled_name is not None
    if not k.do_train:
        detail = (
            "do_train is not true: nothing trains and LLaMA-Factory does not enable checkpointing "
            f"({SOURCES['trainable']})"
        )
        reading.set("gc_enabled", False, "file", detail)
    elif k.disabled:
        detail = f"key 'disable_gradient_checkpointing': {k.disabled!r}"
        reading.set("gc_enabled", bool(k.hf_gc), "file", detail)
    else:
        detail = f"disable_gradient_checkpointing defaults to false: LLaMA-Factory checkpoints ({SOURCES['enable']})"
        reading.set("gc_enabled", True, "file" if given else "launcher default", detail)
    reading.set("gc_flag_source", "user" if given else "trainer", "file", "disable_gradient_checkpointing")
    hyper = _read_hyper_parallel(config, k, reading)
    accel = read_accelerate(ctx.accelerate_config) if ctx.accelerate_config else None
    k.update(fsdp2=bool(accel and accel.fsdp and accel.fsdp_version == 2), reenable=bool(k.hf_gc and k.do_train))
    set_accelerate_facts(reading, accel, f"accelerate config {ctx.accelerate_config}")
    if k.reenable and k.raw.get("gradient_checkpointing_kwargs") is not None:  # the Trainer re-enables with them
        kwargs = k.raw["gradient_checkpointing_kwargs"]
        k["kwargs"] = json_object_or_mapping(
            kwargs, config.path, "gradient_checkpointing_kwargs", config.lines, "{use_reentrant: false}"
        )
    reentrant = rewrite(REENTRANT_GC, k, Reentrant(None, "file", ""))
    hf_override = k.reenable and k.kwargs is None and reentrant.value is not True
    if k.reenable:
        reading.changes["use_reentrant"] = "gradient_checkpointing_kwargs: {{use_reentrant: {value}}}"
    _set_reentrant_facts(k, reading, rewrite(REENABLE, k, reentrant))
    _read_model(k, reading)
    world = _read_launch(config, ctx, k, reading, accel)
    gc_on = bool(reading.value("gc_enabled"))
    tf = ctx.versions.get("transformers")
    string_bools = tuple(key.names[0] for key in FLAGS if isinstance(k[key.field], str))
    view = Values(  # what `RULES` look at: the keys as read, then what the reading left
        k,
        string_bools=string_bools,
        reentrant_default=gc_on and reentrant.origin == "launcher default",
        hf_gc_overrides=hf_override and gc_on,
        fsdp2=k.fsdp2 and gc_on,
        transformers_outside=tf is not None
        and not SUPPORTED_TRANSFORMERS[0] <= release(tf) <= SUPPORTED_TRANSFORMERS[1],
        deepspeed_one_process=reading.value("zero_stage") is not None and world == 1,
        hyper_parallel=hyper,
    )
    befores = {"transformers": tf, "quoted booleans": {n: k.raw[n] for n in string_bools}, "use_hyper_parallel": hyper}
    sources = {"transformers": ctx.version_origins.get("transformers", "installed")}
    reading.apply(RULES, view, VERSION_MODELLED, k.raw, befores, sources)
    return reading


def _read_hyper_parallel(config: Config, k: Values, reading: Reading) -> str | None:
    """HyperParallel's `activation_mode` when `use_hyper_parallel` runs this stage (`unread` when its JSON is not
    found here), None without HyperParallel; `recompute` / `swap` turn transformers' checkpointing off."""
    if not (k.hyper and k.stage in ("pt", "sft")):
        if k.hyper:
            reading.notes.append(
                f"use_hyper_parallel: ignored for stage {k.stage} (LLaMA-Factory runs HyperParallel for pt and "
                f"sft only: {SOURCES['hyper_parallel_stages']})"
            )
        return None
    value = k.raw.get("hyper_parallel_args")
    if value is None:
        mode, detail = "none", "no hyper_parallel_args: HyperParallel's default activation_mode 'none'"
    elif not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{where(config.path, 'hyper_parallel_args', config.lines)}: expected a path to a JSON file, got "
            f"{type_name(value)} {short(value)}"
        )
    else:
        found = find_beside(value, config.base_dir)
        if found is None:
            reading.unread.append(
                f"hyper_parallel_args: {value!r} not found (current directory or next to the config): HyperParallel's "
                "activation_mode is unknown"
            )
            return "unread"
        data = load_json_file(found, "HyperParallel arguments ('hyper_parallel_args')")
        if not isinstance(data, dict):
            raise ConfigError(f"HyperParallel arguments {found}: must be a JSON object, not {type_name(data)}")
        mode = data.get("activation_mode", "none")
        detail = f"{found}: activation_mode {mode!r}"
    if mode in ("recompute", "swap"):
        reading.set(
            "gc_enabled",
            False,
            "launcher rewrite",
            f"{detail}: LLaMA-Factory sets disable_gradient_checkpointing, HyperParallel checkpoints itself "
            f"({SOURCES['hyper_parallel']})",
        )
    else:
        reading.notes.append(
            f"use_hyper_parallel: HyperParallel's FSDP2 backend ({detail}); LLaMA-Factory's own checkpointing stays"
        )
    return str(mode)


def _set_reentrant_facts(k: Values, reading: Reading, reentrant: Reentrant) -> None:
    """`use_unsloth_gc`'s offloading checkpoint (`use_kt` is not modelled), then the final use_reentrant (when
    checkpointing is on), LLaMA-Factory's wrapper, Unsloth and use_cache."""
    if k.unsloth_gc:
        reading.set(
            "activation_offloading",
            "use_unsloth_gc",
            "file",
            "key 'use_unsloth_gc': LLaMA-Factory's offloading checkpoint (ignores use_reentrant)",
        )
    if k.kt:
        reading.notes.append("use_kt: KTransformers checkpointing is not modelled (it chooses its own kwargs)")
    gc_on = bool(reading.value("gc_enabled"))
    origin, detail = reentrant.origin, reentrant.detail
    reading.set("use_reentrant", reentrant.value if gc_on else None, origin, detail)
    reading.set("use_reentrant_source", reentrant.source if gc_on else "unset", origin, detail)
    reading.set(
        "launcher_checkpointing",
        gc_on and not k.unsloth_gc,
        "launcher rewrite",
        f"LLaMA-Factory checkpoints through its own wrapper around transformers' partial ({SOURCES['wrapper']})",
    )
    reading.set("kwargs_given", gc_on, origin, detail)
    reading.set("unsloth", bool(k.unsloth), "file", "key 'use_unsloth' (Unsloth is loaded)")
    reading.set(
        "use_cache",
        False,
        "launcher rewrite",
        f"LLaMA-Factory sets model.config.use_cache False with checkpointing ({SOURCES['enable']})",
    )


def _read_model(k: Values, reading: Reading) -> None:
    """The model (finetuning_type, quantization, the checkpoint wrapper's grads) and the trainer `stage` runs."""
    raw, finetuning, bits, stage = k.raw, k.finetuning_type, k.quantization_bit, k.stage
    peft = finetuning in ("lora", "oft")
    quant = None if bits is None else f"bitsandbytes_{bits}bit" if k.method == "bnb" else str(k.method)
    reading.set_model(
        peft=Fact(
            peft,
            "file" if "finetuning_type" in raw else "launcher default",
            f"finetuning_type: {finetuning}" + ("" if "finetuning_type" in raw else " (the default)"),
        ),
        quant=Fact(
            quant, "file", "quantization_bit / quantization_method" if bits is not None else "no quantization_bit"
        ),
        frozen=Fact(finetuning != "full" or quant is not None, "file", f"finetuning_type: {finetuning}"),
        blocks="a config trains decoder layers (LLaMA-Factory checkpoints only the layers that train)",
        grads=Fact(
            True,
            "launcher rewrite",
            "LLaMA-Factory's checkpoint wrapper makes the hidden states require grad for trainable layers "
            f"({SOURCES['wrapper']})",
        ),
        no_adapter=f"finetuning_type: {finetuning}",
    )
    read_model_facts(raw.get("model_name_or_path"), "model_name_or_path", reading)
    kind_origin: Origin = "file" if "stage" in raw else "launcher default"
    reading.set_trainer(STAGES[stage], "file", f"stage: {stage}", kind_origin)


def _read_launch(config: Config, ctx: Context, k: Values, reading: Reading, accel: Any) -> int:
    """The process count, DeepSpeed, FSDP and DDP's keys (`ddp_find_unused_parameters` False under DDP + LoRA when
    unset); returns the process count."""
    world = reading.set_world_size(
        ctx,
        "no --nproc: 1 process (llamafactory-cli starts torchrun with one process per visible GPU; pass --nproc N)",
        *[(accel.num_processes, "accelerate config", f"{accel.path}: num_processes")] if accel is not None else [],
    )
    ds_value = k.raw.get("deepspeed")
    if ds_value not in (None, "", False):
        if not isinstance(ds_value, (str, dict)):
            raise ConfigError(
                f"{where(config.path, 'deepspeed', config.lines)}: expected a path to a DeepSpeed JSON file, got "
                f"{type_name(ds_value)} {short(ds_value)}"
            )
        read_deepspeed(
            ds_value, config.path, "deepspeed", config.base_dir, BUNDLED_DEEPSPEED, "examples/deepspeed/", config.lines
        ).set_facts(reading)
    elif accel is not None and accel.zero_stage is not None:
        reading.set("zero_stage", accel.zero_stage, "accelerate config", f"{accel.path}: deepspeed_config")
    else:
        reading.set("zero_stage", None, "file", "no deepspeed key")
    fsdp_config = read_fsdp_config(config)
    where_accel = str(accel.path) if accel is not None else ""
    set_fsdp_facts(reading, bool(k.raw.get("fsdp")), fsdp_config, accel, where_accel, ctx.versions.get("transformers"))
    find_unused = k.raw.get("ddp_find_unused_parameters")
    if find_unused is None and world > 1 and k.finetuning_type == "lora":
        reading.set(
            "ddp_find_unused_parameters",
            False,
            "launcher rewrite",
            f"DDP + LoRA: LLaMA-Factory sets it to False ({SOURCES['ddp']})",
        )
    else:
        reading.set_key("ddp_find_unused_parameters", find_unused)
    reading.set_key("ddp_static_graph", k.raw.get("ddp_static_graph"), unset="key 'ddp_static_graph'")
    return world


DEFAULTS = {
    "disable_gradient_checkpointing": False,
    "use_reentrant_gc": True,
    "use_unsloth_gc": False,
    "use_unsloth": False,
    "stage": "sft",
    "finetuning_type": "lora",
    "quantization_bit": None,
    "quantization_method": "bnb",
    "do_train": False,
    "gradient_checkpointing": False,
}
"""The defaults this model assumes; LLaMA-Factory's own parser (when importable) is compared with them."""


def read_native(config: Config, ctx: Context, result: dict[str, Any]) -> Reading:
    """The reading with LLaMA-Factory's own parsed values (`_worker.py`): the file's keys as LLaMA-Factory parsed
    them, and its defaults checked against `DEFAULTS` (a difference is said, and LLaMA-Factory's value used)."""
    native = result.get("values") or {}
    values = dict(config.values)
    notes: list[str] = []
    for key, default in DEFAULTS.items():
        if key not in native:
            continue
        if key in config.values:
            if native[key] != config.values[key]:
                notes.append(
                    f"LLaMA-Factory parsed {key}={native[key]!r} from the file's {config.values[key]!r}; its value is "
                    "used"
                )
                values[key] = native[key]
        elif native[key] != default:
            notes.append(
                f"LLaMA-Factory's default {key}={native[key]!r} differs from the plugin's model ({default!r}); its "
                "value is used"
            )
            values[key] = native[key]
    reading = read(Config(path=config.path, values=values, keys=config.keys, lines=config.lines, kind=config.kind), ctx)
    function = "get_train_args" if is_training_config(config) else "get_infer_args"
    reading.parser = f"LLaMA-Factory {result.get('version', '?')}'s own {function}, in a clean subprocess"
    reading.notes.extend(notes)
    return reading


class LlamaFactoryLauncher(Launcher):
    """LLaMA-Factory's v0 configs: its own `read_args` / `get_train_args` in the worker where it is installed."""

    def no_own_parser(self) -> str | None:
        return None if importable("llamafactory") else "LLaMA-Factory is not importable here"

    def native_job(self, config: Config, ctx: Context) -> dict[str, Any] | None:
        return {"training": is_training_config(config)} if importable("llamafactory") else None

    def with_native(self, config: Config, ctx: Context, reading: Reading, result: dict[str, Any]) -> Reading:
        return read_native(config, ctx, result)


LAUNCHER = LlamaFactoryLauncher(
    "llamafactory",
    "LLaMA-Factory",
    read,
    markers=MARKERS,
    strong_markers=STRONG_MARKERS,
    read_keys=READ_KEYS,
    rules=RULES,
)
