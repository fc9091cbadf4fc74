"""TRL's CLI configs (`trl sft|dpo|grpo|... --config cfg.yaml`): the plugin's model of TRL 1.16's `TrlParser` (what
TRL's own parser read replaces it where that runs: `apply_native`), then what TRL's trainers write (`finish`). Keys
that are no field of its dataclasses go to `accelerate launch` (`LAUNCH_KEYS` override the accelerate config's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from ...core.capabilities import installed_versions
from ...core.kwargs import unknown_checkpoint_keys
from ..read.accelerate import (
    AccelerateConfig,
    read_accelerate,
    set_accelerate_facts,
    trl_bundled,
    trl_bundled_names,
    whole_number,
)
from ..read.common import (
    KWARGS_CHANGES,
    ConfigError,
    Context,
    Fact,
    LauncherRule,
    Reading,
    Reentrant,
    expect_mapping,
    find_beside,
    json_object_or_mapping,
    release,
    short,
    string_to_bool,
    type_name,
    where,
)
from ..read.deepspeed import read_deepspeed
from ..read.load import Config, load_json_file
from ..read.model_config import read_model_facts
from ..read.native import importable
from .base import Launcher
from .schema import Key, Noted, Step, Values, checked, read_keys, rewrite

VERSION_MODELLED = "1.16.0"
SRC = f"https://github.com/huggingface/trl/blob/v{VERSION_MODELLED}/trl/"
SOURCES = {
    "parser": f"{SRC}scripts/utils.py (TrlParser.parse_args_and_config, set_defaults_with_config)",
    "model_config": f"{SRC}trainer/model_config.py (use_peft, load_in_4bit, load_in_8bit)",
    "cli": f"{SRC}cli/commands/training.py (unconsumed keys go to accelerate launch)",
    "peft_zero3": (
        f"{SRC}trainer/sft_trainer.py (PEFT + ZeRO-3: use_reentrant forced to True; same in dpo, grpo, kto, reward, "
        "rloo, distillation)"
    ),
}

CLI_TRAINERS = ("distillation", "dpo", "grpo", "kto", "reward", "rloo", "sft")
"""The training commands of TRL 1.16's CLI (`trl/cli/commands/__init__.py`)."""

MARKERS = frozenset(
    {
        "use_peft",
        "dataset_name",
        "dataset_config",
        "dataset_train_split",
        "dataset_test_split",
        "dataset_streaming",
        "dataset_text_field",
        "accelerate_config",
        "lora_task_type",
        "use_bnb_nested_quant",
        "bnb_4bit_quant_type",
        "model_init_kwargs",
    }
)
"""Keys only TRL's CLI configs use (ScriptArguments, ModelConfig, SFTConfig, the CLI). Not `lora_target_modules`
or `lora_modules_to_save`: Axolotl's configs use them too."""

STRONG_MARKERS = frozenset({"use_peft", "dataset_name", "dataset_config", "dataset_train_split", "accelerate_config"})

LAUNCH_KEYS = ("num_processes", "zero_stage", "deepspeed_config_file", "fsdp_version", "fsdp_activation_checkpointing")
"""Top-level keys TRL hands to `accelerate launch` that the check reads (they override the accelerate config)."""

VALUELESS_LAUNCH_FLAGS = ("use_deepspeed", "use_fsdp", "multi_gpu", "use_megatron_lm", "tpu", "cpu", "no_python")
"""`accelerate launch` flags that take no value: a YAML key `use_deepspeed: true` becomes `--use_deepspeed True`."""


@dataclass(frozen=True)
class View:
    """What TRL's own checks look at (the predicates of `RULES` read it)."""

    load_in_4bit: bool
    load_in_8bit: bool
    launch_flags: tuple[str, ...]
    peft_zero3_gc: bool
    user_reentrant: Any


RULES: tuple[LauncherRule, ...] = (
    LauncherRule(
        id="trl:4bit-and-8bit",
        action="error",
        setting="load_in_4bit",
        condition="`load_in_4bit` and `load_in_8bit` both true",
        message="TRL's ModelConfig refuses to start: \"You can't use 8 bit and 4 bit precision at the same time\".",
        change="keep only one of `load_in_4bit: true` / `load_in_8bit: true`",
        evidence=(SOURCES["model_config"],),
        when=lambda v: v.load_in_4bit and v.load_in_8bit,
    ),
    LauncherRule(
        id="trl:valueless-launch-flag",
        action="error",
        setting="accelerate launch",
        condition=(
            "a key that is an `accelerate launch` flag without a value (`use_deepspeed`, `multi_gpu`, `use_fsdp`, ...)"
        ),
        message=(
            "`trl` passes keys that are not fields of its configs to `accelerate launch` as `--key value`; these "
            "flags take no value, so `--use_deepspeed True` makes accelerate take `True` as the training script and "
            "the launch fails."
        ),
        change="remove the flag and name an accelerate config instead (`accelerate_config: zero3`, or a path)",
        evidence=(SOURCES["cli"], SOURCES["parser"]),
        when=lambda v: bool(v.launch_flags),
    ),
    LauncherRule(
        id="trl:peft-zero3-forces-reentrant",
        action="warn",
        setting="use_reentrant",
        condition="PEFT + DeepSpeed ZeRO-3 + checkpointing, and the file sets `use_reentrant: false`",
        message=(
            "TRL's trainer replaces your use_reentrant=False with True for PEFT under ZeRO-3 (it logs a warning), "
            "so the run is reentrant whatever the file says."
        ),
        evidence=(SOURCES["peft_zero3"],),
        when=lambda v: v.peft_zero3_gc and v.user_reentrant is False,
        disagreement=(
            "since DeepSpeed 0.19.3 (PR 8148) non-reentrant works with PEFT under ZeRO-3; the plugin requires "
            "reentrant only on older DeepSpeed, and otherwise keeps the trainer's value (a preference never "
            "overrides a value a trainer wrote)."
        ),
    ),
    LauncherRule(
        id="trl:peft-zero3-reentrant",
        action="none",
        setting="use_reentrant",
        condition="PEFT + DeepSpeed ZeRO-3 + checkpointing (use_reentrant unset or true)",
        message="TRL's trainer sets use_reentrant=True for PEFT under ZeRO-3.",
        evidence=(SOURCES["peft_zero3"],),
        when=lambda v: v.peft_zero3_gc and v.user_reentrant is not False,
        disagreement=(
            "the plugin prefers non-reentrant, but keeps a value a trainer wrote; on DeepSpeed < 0.19.3 it requires "
            "reentrant here too."
        ),
    ),
)


REENTRANT = (  # what TRL's trainers write into gradient_checkpointing_kwargs (the later step wins)
    Step(
        lambda f, _: f.gc and f.user is None and f.tf4,
        False,
        "trl {kind} on transformers < 5: setdefault(use_reentrant=False) ({kind}_trainer.py)",
    ),
    Step(
        lambda f, _: f.gc and f.peft and f.zero3,
        True,
        "trl {kind}: PEFT + DeepSpeed ZeRO-3 forces use_reentrant=True ({kind}_trainer.py)",
    ),
)


def trl_bool(config: Config, key: str, value: Any) -> Any:
    """A boolean field as `TrlParser` reads it (a `Key` kind; None when absent or null): a string through
    `string_to_bool` (an unknown word is a `ConfigError`, as TRL exits on it); other values pass through and count by
    truthiness."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        parsed = string_to_bool(value)
        if parsed is None:
            raise ConfigError(
                f"{where(config.path, key, config.lines)}: TRL reads {short(value)} as no boolean (it accepts yes/no, "
                "true/false, t/f, y/n, 1/0) and exits with 'Truthy value expected'; write true or false"
            )
        return parsed
    on = "on" if value else "off"
    return Noted(bool(value), f"{key}: {short(value)} is not a boolean; TRL passes it through and it counts as {on}")


_MAPPING = checked(lambda v: isinstance(v, dict), "TRL requires a mapping of environment variables, got {type} {value}")
FIRST = (  # TRL's keys in the order it reads them: these, the checkpointing kwargs, `MODEL`, the launch, `DDP`
    Key("env", ("env",), _MAPPING),
    Key("gc", ("activation_checkpointing", "gradient_checkpointing"), trl_bool),  # null: off; unset: on
)
MODEL = (
    Key("offloading", ("activation_offloading",), trl_bool),
    Key("peft", ("use_peft",), trl_bool),
    Key("load_in_4bit", ("load_in_4bit",), trl_bool),
    Key("load_in_8bit", ("load_in_8bit",), trl_bool),
)
DDP = (  # unset: transformers decides
    Key("ddp_find_unused_parameters", ("ddp_find_unused_parameters",), trl_bool),
    Key("ddp_static_graph", ("ddp_static_graph",), trl_bool),
)

READ_KEYS = frozenset(
    {
        *(name for key in (*FIRST, *MODEL, *DDP) for name in key.names),
        *("model_name_or_path", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "deepspeed"),
        *("fsdp", "fsdp_config", "accelerate_config", *LAUNCH_KEYS, *VALUELESS_LAUNCH_FLAGS),
    }
)


def read(config: Config, ctx: Context) -> Reading:
    """The plugin's model of how `trl <command> --config` reads `config` (see the module docstring)."""
    reading = Reading(
        format="trl", parser=f"the plugin's model of TRL {VERSION_MODELLED}'s TrlParser", changes=dict(KWARGS_CHANGES)
    )
    _read_checkpointing(config, read_keys(config, FIRST, notes=reading.notes), reading)
    k = read_keys(config, MODEL, notes=reading.notes)
    if k.offloading is not None:
        reading.set("trl_activation_offloading", k.offloading, "file", "key 'activation_offloading'")
    peft, four, eight = k.peft, bool(k.load_in_4bit), bool(k.load_in_8bit)
    reading.extra.update(load_in_4bit=four, load_in_8bit=eight)
    quant = "bitsandbytes_4bit" if four else "bitsandbytes_8bit" if eight else None
    reading.set_model(
        peft=Fact(bool(peft), "file", "key 'use_peft'")
        if peft is not None
        else Fact(False, "launcher default", "use_peft defaults to False (no adapter)"),
        quant=Fact(quant, "file" if quant else "launcher default", "load_in_4bit / load_in_8bit"),
        frozen=Fact(
            bool(peft) or quant is not None, "file", "an adapter or a quantized model freezes the base weights"
        ),
        blocks="a config trains the decoder blocks (full or through adapters)",
        grads=Fact(
            True,
            "launcher rewrite",
            "TRL calls enable_input_require_grads() for PEFT; without an adapter the embeddings train",
        ),
    )
    read_launch(config, ctx, reading)
    k = read_keys(config, DDP, notes=reading.notes)
    for key in ("ddp_find_unused_parameters", "ddp_static_graph"):
        given = k[f"{key}_name"] is not None
        detail = f"key {key!r}" if given else "unset: transformers decides"
        reading.set(key, k[key], "file" if given else "launcher default", detail)
    read_model_facts(config.get("model_name_or_path"), "model_name_or_path", reading)
    kind = ctx.trainer or "sft"
    if kind not in CLI_TRAINERS:
        raise ConfigError(
            f"--trainer {kind}: TRL's CLI has no `trl {kind}` command ({', '.join(CLI_TRAINERS)}); a TRL config is for "
            "one of these"
        )
    set_trainer_kind(reading, kind, ctx, "`trl sft` (pass --trainer dpo|grpo|... for another command)", f"trl {kind}")
    return reading


def _read_checkpointing(config: Config, k: Values, reading: Reading) -> None:
    """Checkpointing on/off (`gradient_checkpointing`, default True, or `activation_checkpointing`) and its kwargs."""
    gc, flag_key = k.gc, k.gc_name or "gradient_checkpointing"
    if gc is None and k.gc_name is not None:
        reading.set("gc_enabled", False, "file", f"key {flag_key!r}: null (off)")
    elif gc is None:
        reading.set("gc_enabled", True, "launcher default", "TRL's configs default gradient_checkpointing to True")
    else:
        reading.set("gc_enabled", gc, "file", f"key {flag_key!r}")
    given = k.gc_name is not None
    reading.set("gc_flag_source", "user" if given else "trainer", "file" if given else "launcher default", flag_key)
    if flag_key == "activation_checkpointing":
        reading.changes["activation_checkpointing"] = "activation_checkpointing: {value}"
    kwargs_key = read_kwargs_key(config.get, config.path, config.lines, "{use_reentrant: false}", reading)
    if kwargs_key is not None:
        reading.changes["use_reentrant"] = kwargs_key + ": {{use_reentrant: {value}}}"


def set_trainer_kind(reading: Reading, kind: str, ctx: Context, assumed: str, label: str) -> None:
    """The trainer facts: `--trainer` when given, else the format's `assumed` trainer."""
    given = ctx.trainer is not None
    reading.set_trainer(kind, "option" if given else "assumed", label, kind_detail="--trainer" if given else assumed)


def read_kwargs_key(get: Any, path: str, lines: Any, example: str, reading: Reading) -> str | None:
    """Transformers' checkpointing kwargs (`activation_checkpointing_kwargs` first, as transformers >= 5.23 reads
    them), a JSON string or a mapping, into the kwargs facts; returns the key given (None: neither)."""
    key = next(
        (k for k in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs") if get(k) is not None), None
    )
    kwargs = json_object_or_mapping(get(key), path, key, lines, example) if key is not None else None
    name = key or "gradient_checkpointing_kwargs"
    reentrant = None if kwargs is None else kwargs.get("use_reentrant")
    if kwargs is None:
        detail = f"no {name}"
    else:
        detail = f"key {name}.use_reentrant" if reentrant is not None else f"{name} has no use_reentrant"
    reading.set("kwargs_given", kwargs is not None, "file", detail if kwargs is None else f"key {name!r}")
    reading.set("use_reentrant", reentrant, "file", detail)
    reading.set("use_reentrant_source", "unset" if reentrant is None else "user", "file", detail)
    if kwargs is None:
        return key
    read_kwargs_keys(reading, kwargs, name)
    if "every_n_layers" in kwargs:
        reading.set("every_n_layers", kwargs["every_n_layers"], "file", f"key {key}.every_n_layers")
    if kwargs.get("offload"):
        reading.set("offload", True, "file", f"key {key}.offload")
    if "preserve_rng_state" in kwargs:
        reading.set("preserve_rng_state", kwargs["preserve_rng_state"], "file", f"key {key}.preserve_rng_state")
    if "context_fn" in kwargs:
        reading.set("selective", True, "file", f"key {key}.context_fn")


def read_kwargs_keys(reading: Reading, kwargs: dict[str, Any], key: str) -> None:
    """The keys of the checkpointing kwargs besides use_reentrant, and those nothing reads."""
    extra = tuple(sorted(k for k in kwargs if k != "use_reentrant"))
    if extra:
        reading.set("kwargs_keys", extra, "file", f"keys of {key}")
    unknown = unknown_checkpoint_keys(kwargs)
    if unknown:
        reading.set("kwargs_unknown", unknown, "file", f"keys of {key} nothing reads")


def read_launch(config: Config, ctx: Context, reading: Reading) -> None:
    """DeepSpeed, FSDP and the process count: from `TrainingArguments` keys and the accelerate config (DDP's keys
    each launcher parses its own way)."""
    reading.extra["launch_flags"] = tuple(k for k in VALUELESS_LAUNCH_FLAGS if k in config.values)
    overrides = {k: config.values[k] for k in LAUNCH_KEYS if config.values.get(k) is not None}
    accel, where_accel = _read_accelerate_config(config, ctx, reading, overrides)
    # the process count: --nproc, else the file's `num_processes` (over the accelerate config's), else 1
    file_detail, given = "key 'num_processes' (passed to accelerate launch)", "num_processes" in overrides
    procs = (
        whole_number(overrides["num_processes"], config.path, "num_processes", 1) if given and accel is None else None
    )
    accel_procs = accel.num_processes if accel is not None else None
    reading.set_world_size(
        ctx,
        "no --nproc, no num_processes: 1 process (accelerate launch's default without a config)",
        (procs, "file", file_detail),
        (accel_procs, "file", file_detail)
        if given
        else (accel_procs, "accelerate config", f"{where_accel}: num_processes"),
    )
    set_accelerate_facts(reading, accel, where_accel)
    ds_value = config.get("deepspeed")  # else the accelerate config's DeepSpeed
    if ds_value not in (None, "", False):  # read_deepspeed refuses any other type, naming the key
        read_deepspeed(ds_value, config.path, "deepspeed", config.base_dir, {}, "", config.lines).set_facts(reading)
    elif accel is not None and accel.zero_stage is not None:
        reading.set("zero_stage", accel.zero_stage, "accelerate config", f"{where_accel}: deepspeed_config")
        reading.set(
            "deepspeed_activation_checkpointing",
            accel.deepspeed_activation_checkpointing,
            "accelerate config",
            where_accel,
        )
    else:
        reading.set("zero_stage", None, "file", "no deepspeed key and no DeepSpeed accelerate config")
    fsdp, fsdp_config = bool(config.get("fsdp")), read_fsdp_config(config)  # else the accelerate config's FSDP
    set_fsdp_facts(reading, fsdp, fsdp_config, accel, where_accel, ctx.versions.get("transformers"))


def _read_accelerate_config(
    config: Config, ctx: Context, reading: Reading, overrides: dict[str, Any]
) -> tuple[AccelerateConfig | None, str]:
    """The accelerate config: --accelerate-config, else the file's `accelerate_config` key (a path, else a config TRL
    ships), with the file's launch keys overriding it; returns it and how to name it in a detail."""
    path, lines = config.path, config.lines
    name = ctx.accelerate_config if ctx.accelerate_config is not None else config.get("accelerate_config")
    if ctx.accelerate_config is not None and config.get("accelerate_config") not in (None, ctx.accelerate_config):
        reading.notes.append(
            f"--accelerate-config {ctx.accelerate_config} replaces the file's accelerate_config: "
            f"{config.get('accelerate_config')}"
        )
    if name is None:
        return None, ""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(
            f"{where(path, 'accelerate_config', lines)}: expected a path or the name of a config TRL ships, got "
            f"{type_name(name)} {short(name)}"
        )
    file = name if os.path.isfile(name) else trl_bundled(name)
    if file is None:
        raise ConfigError(
            f"{where(path, 'accelerate_config', lines)}: {name!r} is neither a file (from the current directory) nor a "
            f"config TRL ships ({', '.join(trl_bundled_names()) or 'none found'}); TRL refuses it"
        )
    accel = read_accelerate(file, overrides)
    return accel, f"accelerate config {name} ({accel.path})"


def set_fsdp_facts(
    reading: Reading, asked: bool, fsdp_config: dict[str, Any], accel: Any, where_accel: str, transformers: str | None
) -> None:
    """Record the FSDP facts: from the file's `fsdp` / `fsdp_config` when it asks for FSDP, else from the accelerate
    config the launch uses, else no FSDP."""
    if asked:
        version = fsdp_config.get("version")
        version = version if isinstance(version, int) and not isinstance(version, bool) else None
        reading.set("fsdp", True, "file", "key 'fsdp'")
        reading.set(
            "fsdp_activation_checkpointing",
            bool(fsdp_config.get("activation_checkpointing")),
            "file",
            "key 'fsdp_config.activation_checkpointing'",
        )
        reading.set(
            "fsdp_version",
            version if version in (1, 2) else 2 if release(transformers) >= (5, 10) else 1,
            "file" if "version" in fsdp_config else "launcher default",
            "fsdp_config.version" if "version" in fsdp_config else "transformers' default (2 from 5.10, 1 before)",
        )
    elif accel is not None and accel.fsdp:
        reading.set("fsdp", True, "accelerate config", f"{where_accel}: distributed_type FSDP")
        reading.set(
            "fsdp_activation_checkpointing",
            accel.fsdp_activation_checkpointing,
            "accelerate config",
            f"{where_accel}: fsdp_activation_checkpointing",
        )
        reading.set("fsdp_version", accel.fsdp_version, "accelerate config", f"{where_accel}: fsdp_version")
    else:
        reading.set("fsdp", False, "file", "no fsdp key and no FSDP accelerate config")
        reading.set("fsdp_activation_checkpointing", False, "file", "no FSDP")


def read_fsdp_config(config: Config) -> dict[str, Any]:
    """`fsdp_config`: a mapping or a path to a JSON file, with `fsdp_` prefixes dropped (as `TrainingArguments`
    does); `activation_checkpointing` parsed to a bool."""
    value = config.get("fsdp_config")
    if value in (None, ""):
        return {}
    if isinstance(value, str):
        file = find_beside(value, config.base_dir) or os.path.join(config.base_dir, value)
        value = load_json_file(file, "FSDP config (key 'fsdp_config')")
    value = expect_mapping(value, config.path, "fsdp_config", config.lines, "{activation_checkpointing: true}")
    out = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in value.items()}
    ac = out.get("activation_checkpointing", False)
    parsed = string_to_bool(ac) if isinstance(ac, str) else bool(ac)
    if parsed is None:
        raise ConfigError(
            f"{where(config.path, 'fsdp_config.activation_checkpointing', config.lines)}: expected true or false, got "
            f"{short(ac)}"
        )
    out["activation_checkpointing"] = parsed
    return out


def finish(config: Config, ctx: Context, reading: Reading) -> None:
    """What TRL's trainers write themselves, and TRL's own verdicts (after the model or TRL's parser has read the
    file)."""
    tf = ctx.versions.get("transformers")
    gc = bool(reading.value("gc_enabled"))
    peft = bool(reading.value("is_peft"))
    zero3 = reading.value("zero_stage") == 3
    user_value = reading.value("use_reentrant")
    kind = reading.value("trainer_kind", "sft")
    facts = Values(gc=gc, peft=peft, zero3=zero3, user=user_value, tf4=tf is not None and release(tf)[0] < 5, kind=kind)
    forced = rewrite(REENTRANT, facts, Reentrant(user_value, "file", ""))
    if forced.origin == "launcher rewrite":
        reading.set("use_reentrant", forced.value, forced.origin, forced.detail)
        reading.set("use_reentrant_source", "trainer", "launcher rewrite", f"TRL's {kind} trainer")
        reading.set("kwargs_given", True, "launcher rewrite", f"TRL's {kind} trainer")
    view = View(
        load_in_4bit=bool(reading.extra.get("load_in_4bit")),
        load_in_8bit=bool(reading.extra.get("load_in_8bit")),
        launch_flags=tuple(reading.extra.get("launch_flags", ())),
        peft_zero3_gc=gc and peft and zero3,
        user_reentrant=user_value,
    )
    flags = [k for k in VALUELESS_LAUNCH_FLAGS if k in config.values]
    befores = {"use_reentrant": user_value, "accelerate launch": flags}
    reading.apply(RULES, view, f"TRL {VERSION_MODELLED}", config.values, befores, {"use_reentrant": "user"})


NATIVE_FIELDS = ("gc_enabled", "use_reentrant", "kwargs_given", "ddp_find_unused_parameters", "ddp_static_graph")

UNKNOWN_KEY_RULE = LauncherRule(
    id="trl:unknown-key",
    action="error",
    setting="config keys",
    condition="a key that is no field of the command's dataclasses and no `accelerate launch` argument",
    message=(
        "`trl` passes keys that are not fields of its configs to `accelerate launch`, which does not know these "
        "either: the launch stops with 'accelerate launch: error: unrecognized arguments' (read by TRL's and "
        "accelerate's own parsers, for the installed transformers)."
    ),
    change="remove the key(s), or rename them to the field of the installed transformers/TRL",
    evidence=(
        SOURCES["cli"],
        "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/commands/launch.py "
        "(launch_command_parser)",
    ),
    when=lambda v: True,
)


def apply_native(config: Config, ctx: Context, reading: Reading, result: dict[str, Any]) -> None:
    """Replace the model's facts by what TRL's own parser read (`_worker.py`), saying where they differ."""
    kind = reading.value("trainer_kind", "sft")
    reading.parser = f"TRL {result.get('version', '?')}'s own TrlParser (`trl {kind}`), in a clean subprocess"
    facts = result.get("facts") or {}

    def agree(name: str, native: Any) -> None:
        model = reading.facts.get(name)
        if model is None:
            reading.set(name, native, "file", "read by TRL's parser")
            return
        if model.value != native or type(model.value) is not type(native):
            reading.notes.append(
                f"the plugin's model of TRL read {name}={model.value!r}, TRL's own parser {native!r}: TRL's value is "
                "used"
            )
            reading.set(name, native, model.origin, f"{model.detail} (read by TRL's parser)")

    for name in NATIVE_FIELDS:
        if name in facts:
            agree(name, facts[name])
    if reading.facts["use_reentrant"].value is None:
        reading.set("use_reentrant_source", "unset", "file", "no use_reentrant (TRL's parser)")
    if "deepspeed" in config.values and "zero_stage" in facts and facts["zero_stage"] is not None:
        agree("zero_stage", facts["zero_stage"])
    if "deepspeed" in config.values and "zero_overlap_comm" in facts:
        agree("zero_overlap_comm", facts["zero_overlap_comm"])
    if reading.facts["fsdp"].origin == "file":
        agree("fsdp", bool(facts.get("fsdp")))
        if facts.get("fsdp"):
            agree("fsdp_activation_checkpointing", bool(facts.get("fsdp_activation_checkpointing")))
            if "fsdp_version" in facts:
                agree("fsdp_version", facts["fsdp_version"])
    agree("is_peft", bool(result.get("use_peft")))
    four, eight = bool(result.get("load_in_4bit")), bool(result.get("load_in_8bit"))
    agree("quantization", "bitsandbytes_4bit" if four else "bitsandbytes_8bit" if eight else None)
    reading.extra.update(load_in_4bit=four, load_in_8bit=eight)
    if result.get("valueless_keys"):
        reading.extra["launch_flags"] = tuple(result["valueless_keys"])
    unknown = list(result.get("unknown_keys") or ())
    if unknown:
        rule = UNKNOWN_KEY_RULE
        if ctx.versions.get("transformers") != installed_versions().get("transformers"):
            rule = replace(
                rule,
                action="warn",
                message=rule.message
                + " Checked with the installed transformers, not the --transformers-version given.",
            )
        known_by: dict[str, list[str]] = result.get("known_by") or {}
        others = sorted({c for key in unknown for c in known_by.get(key, [])})
        if others:  # a field of another command: the file is for `trl grpo`, say, not `trl sft`
            where_known = "; ".join(
                f"{key} is a field of {', '.join('trl ' + c for c in known_by[key])}"
                for key in unknown
                if known_by.get(key)
            )
            rule = replace(
                rule,
                message=rule.message + f" ({where_known}.)",
                change=(
                    f"pass --trainer {'|'.join(others)} if the file is for that command ({where_known}), or remove "
                    "the key"
                ),
            )
        reading.decisions.append(rule.decision(f"TRL {result.get('version', '?')}", before=unknown))
        reading.changes_for[rule.id] = rule.change


class TrlLauncher(Launcher):
    """TRL's CLI configs: TRL's own `TrlParser` in the worker where TRL is installed and the trainer is one of its
    commands; what TRL's trainers write themselves, after either reading (`finish`)."""

    def native_job(self, config: Config, ctx: Context) -> dict[str, Any] | None:
        trainer = ctx.trainer or "sft"
        return {"trainer": trainer} if importable("trl") and trainer in CLI_TRAINERS else None

    def with_native(self, config: Config, ctx: Context, reading: Reading, result: dict[str, Any]) -> Reading:
        apply_native(config, ctx, reading, result)
        return reading

    def finish(self, config: Config, ctx: Context, reading: Reading) -> None:
        finish(config, ctx, reading)


LAUNCHER = TrlLauncher(
    "trl", "TRL", read, markers=MARKERS, strong_markers=STRONG_MARKERS, read_keys=READ_KEYS, rules=RULES
)
