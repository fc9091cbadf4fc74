"""Plain `TrainingArguments` JSON files (`HfArgumentParser(TrainingArguments).parse_json_file(...)`). Its `parse_dict`
converts nothing: a string `"false"` counts as true. `gradient_checkpointing` defaults to False. The file names no
model: PEFT, quantization and frozen layers stay unknown (the callback decides them at runtime).
"""

from __future__ import annotations

from ..read.common import Context, LauncherRule, Reading
from ..read.load import Config
from .base import Launcher
from .trl import read_kwargs_key, read_launch, set_trainer_kind

SOURCES = {
    "parse_dict": (
        "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/hf_argparser.py (parse_json_file "
        "-> parse_dict: dataclass(**values), no string conversion)"
    ),
    "default": (
        "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/training_args.py "
        "(gradient_checkpointing: bool = False)"
    ),
}

KEYS = frozenset(
    {
        "output_dir",
        "per_device_train_batch_size",
        "learning_rate",
        "num_train_epochs",
        "max_steps",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "activation_checkpointing",
        "activation_checkpointing_kwargs",
        "bf16",
        "fp16",
        "logging_steps",
        "save_steps",
        "deepspeed",
        "fsdp",
    }
)
"""Fields that tell a plain arguments file (when no launcher's key is present)."""

BOOL_KEYS = ("gradient_checkpointing", "activation_checkpointing", "ddp_find_unused_parameters", "ddp_static_graph")
READ_KEYS = frozenset(
    {*BOOL_KEYS, "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "deepspeed", "fsdp", "fsdp_config"}
)


RULES: tuple[LauncherRule, ...] = (
    LauncherRule(
        id="training-args:string-boolean",
        action="warn",
        setting="gradient_checkpointing",
        condition='a boolean field written as a string (`"gradient_checkpointing": "false"`)',
        message='parse_json_file converts no string: a non-empty string such as "false" counts as true.',
        change="write JSON booleans (true / false, unquoted)",
        evidence=(SOURCES["parse_dict"],),
        when=bool,  # on the boolean keys written as strings
    ),
)


def read(config: Config, ctx: Context) -> Reading:
    path, lines = config.path, config.lines
    reading = Reading(
        format="training-args",
        parser="the plugin's model of transformers' HfArgumentParser.parse_json_file",
        changes={
            "use_reentrant": '"gradient_checkpointing_kwargs": {{"use_reentrant": {value}}}',
            "activation_checkpointing": '"gradient_checkpointing": {value}',
        },
    )
    raw = config.values
    flag_key = "activation_checkpointing" if "activation_checkpointing" in raw else "gradient_checkpointing"
    if flag_key in raw:
        reading.set("gc_enabled", bool(raw[flag_key]), "file", f"key {flag_key!r}")
        reading.set("gc_flag_source", "user", "file", f"key {flag_key!r}")
    else:
        reading.set(
            "gc_enabled", False, "launcher default", "TrainingArguments defaults gradient_checkpointing to False"
        )
        reading.set("gc_flag_source", "unset", "launcher default", "gradient_checkpointing")
    read_kwargs_key(raw.get, path, lines, '{"use_reentrant": false}', reading)
    read_launch(config, ctx, reading)
    for key in ("ddp_find_unused_parameters", "ddp_static_graph"):
        reading.set_key(key, raw.get(key))
    kind = ctx.trainer or "trainer"
    set_trainer_kind(reading, kind, ctx, "transformers' Trainer (pass --trainer sft|dpo|... for a TRL trainer)", kind)
    reading.notes.append(
        "a TrainingArguments file names no model: PEFT, quantization and frozen layers are unknown here, so the rules "
        "that need them do not apply; the callback decides them from the model at runtime"
    )
    string_bools = [k for k in BOOL_KEYS if isinstance(raw.get(k), str)]
    reading.apply(RULES, string_bools, "transformers", raw, {"gradient_checkpointing": string_bools})
    return reading


LAUNCHER = Launcher("training-args", "training-args", read, read_keys=READ_KEYS, rules=RULES)
"""A plain `TrainingArguments` JSON file: no marker key (`detect` tells it by its fields, `KEYS`)."""
