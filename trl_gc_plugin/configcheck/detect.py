"""Which launcher a config is for, from its keys: one launcher's strong markers, else its markers, decide; several
are ambiguous and refused (`--format` says which). Without markers, `model_name_or_path` means TRL and a JSON file of
`TrainingArguments` fields a plain arguments file; an accelerate or DeepSpeed config is named as such. The result
always says why: the format is never guessed silently.
"""

from __future__ import annotations

from .launchers import LAUNCHERS, training_args
from .read.common import Config, ConfigError, NotTrainingConfig

FORMATS = tuple(LAUNCHERS)
MARKERS = {name: launcher.markers for name, launcher in LAUNCHERS.items() if launcher.markers}
STRONG = {name: launcher.strong_markers for name, launcher in LAUNCHERS.items() if launcher.markers}
ACCELERATE_KEYS = frozenset({"distributed_type", "compute_environment"})
DEEPSPEED_KEYS = frozenset({"zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size"})
LLAMAFACTORY_V1_KEYS = frozenset({"model_class", "dist_config", "peft_config", "train_dataset"})


def _names(keys: set[str]) -> str:
    return ", ".join(sorted(keys)[:4]) + (", ..." if len(keys) > 4 else "")


def detect(config: Config, forced: str = "auto") -> tuple[str, str]:
    """`(format, why)` for `config`."""
    keys = set(config.keys)
    command = "verl" if "verl_entry" in config.values else "openrlhf"
    if forced != "auto" and config.kind == "command" and forced != command:
        raise ConfigError(
            f"{config.path}: --format {forced}: the script runs a {LAUNCHERS[command].title} command, "
            f"not a {forced} config"
        )
    if forced != "auto":
        return forced, "--format"
    if config.kind == "command" and command == "verl":
        return "verl", f"the command runs {config.values['verl_entry']}"
    if config.kind == "command":
        return "openrlhf", f"the command runs openrlhf.cli.{config.values.get('openrlhf_entry')}"
    if keys & LLAMAFACTORY_V1_KEYS and "model" in keys:
        raise ConfigError(
            f"{config.path}: a LLaMA-Factory v1 config (USE_V1=1: {_names(keys & LLAMAFACTORY_V1_KEYS)}); only v0 "
            "configs are supported"
        )
    found = {name: keys & markers for name, markers in STRONG.items() if keys & markers}
    if not found:
        found = {name: keys & markers for name, markers in MARKERS.items() if keys & markers}
    if len(found) == 1:
        ((name, hits),) = found.items()
        return name, f"keys only {name} configs use: {_names(hits)}"
    if len(found) > 1:
        parts = "; ".join(f"{name} ({_names(hits)})" for name, hits in found.items())
        raise ConfigError(
            f"{config.path}: keys of several launchers: {parts}; pass --format "
            "trl|axolotl|llamafactory|openrlhf|training-args"
        )
    if keys & ACCELERATE_KEYS:
        raise NotTrainingConfig(
            f"{config.path}: an accelerate launch config ({_names(keys & ACCELERATE_KEYS)}), not a training config; "
            "check the training config and pass this one with --accelerate-config"
        )
    if keys & DEEPSPEED_KEYS and not keys & training_args.KEYS - DEEPSPEED_KEYS:
        raise NotTrainingConfig(
            f"{config.path}: a DeepSpeed config ({_names(keys & DEEPSPEED_KEYS)}), not a training config; check the "
            "training config that names it"
        )
    if "model_name_or_path" in keys:
        return (
            "trl",
            "model_name_or_path and no key only Axolotl or LLaMA-Factory uses (--format llamafactory if it is one)",
        )
    if config.kind == "json" and keys & training_args.KEYS:
        return (
            "training-args",
            f"a JSON file of TrainingArguments fields ({_names(keys & training_args.KEYS)}) and no launcher's key "
            "(--format trl if it is a TRL config)",
        )
    raise NotTrainingConfig(
        f"{config.path}: unrecognised format: no key of a TRL (model_name_or_path, use_peft, ...), Axolotl "
        "(base_model, ...) or LLaMA-Factory (stage, finetuning_type, ...) config; pass --format "
        "trl|axolotl|llamafactory|openrlhf|training-args"
    )
