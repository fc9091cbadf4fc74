"""`python -m trl_gc_plugin check CONFIG`: run the rule engine on a config file before launching.

Reads a TRL CLI config (the YAML/JSON `trl sft --config` takes, `ModelConfig` keys included) or an Axolotl YAML,
turns what the file can say into `Facts` (what it cannot, such as the process count, comes from options), and
returns the decisions strict mode would take. No model is loaded and nothing heavy is imported.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ._flags import parse_flag
from .engine import decide
from .facts import Facts
from .modes import Mode
from .probe import GENERATING_TRAINERS, RL_TRAINERS, installed_versions


class ConfigError(ValueError):
    """The config cannot be read; the message names the file, and the key or line."""


AXOLOTL_KEYS = frozenset({"base_model", "adapter", "unfrozen_parameters", "rl", "datasets", "sequence_len"})
TRL_KEYS = frozenset({"model_name_or_path", "use_peft", "dataset_name", "output_dir"})


@dataclass(frozen=True)
class Launch:
    """What the file cannot say. Args: nproc (processes), trainer (TRL trainer kind for TRL configs), versions
    (overrides of the installed versions, e.g. to check for another transformers)."""

    nproc: int = 1
    trainer: str = "sft"
    versions: tuple[tuple[str, str], ...] = ()


def load(path: str) -> dict[str, Any]:
    """The config as a dict (YAML or JSON); `ConfigError` with the line for a syntax error."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            raise ConfigError(f"{path}: {where}{getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, not {type(data).__name__}")
    return data


def detect(config: dict[str, Any]) -> str:
    """`axolotl` or `trl`, from the keys."""
    if AXOLOTL_KEYS & set(config) and "model_name_or_path" not in config:
        return "axolotl"
    return "trl"


def _kwargs(config: dict[str, Any], path: str) -> tuple[bool, Any]:
    for key in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}: key {key!r}: not a JSON object: {exc.msg}") from None
        if not isinstance(value, dict):
            raise ConfigError(
                f"{path}: key {key!r}: expected a mapping such as {{use_reentrant: false}}, got {value!r}"
            )
        return ("use_reentrant" in value, value.get("use_reentrant"))
    return (False, None)


def _zero_stage(value: Any, base_dir: str, path: str) -> int | None:
    if value in (None, "", False):
        return None
    if isinstance(value, dict):
        config = value
    elif isinstance(value, str):
        file = value if os.path.isabs(value) else os.path.join(base_dir, value)
        if not os.path.isfile(file):  # Axolotl names its bundled configs zero1.json ... zero3_bf16.json
            digits = [int(c) for c in os.path.basename(value) if c.isdigit()]
            return digits[0] if "zero" in value.lower() and digits else 0
        try:
            with open(file, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: key 'deepspeed': cannot read {file}: {exc}") from None
    else:
        raise ConfigError(f"{path}: key 'deepspeed': expected a path or a mapping, got {value!r}")
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    return int(stage) if str(stage).isdigit() else None


def facts_from_config(config: dict[str, Any], path: str, launch: Launch) -> Facts:
    """Facts a config file tells (`stage="init_end"`: the model-dependent rules run on what the keys imply)."""
    flavour = detect(config)
    versions = dict(installed_versions())
    versions.update(dict(launch.versions))
    given, use_reentrant = _kwargs(config, path)
    base_dir = os.path.dirname(os.path.abspath(path))
    four = bool(config.get("load_in_4bit")) or config.get("adapter") == "qlora"
    eight = bool(config.get("load_in_8bit"))
    quantization = "bitsandbytes_4bit" if four else "bitsandbytes_8bit" if eight else None
    fsdp_config = config.get("fsdp_config") or {}
    if flavour == "axolotl":
        gc = bool(config.get("gradient_checkpointing"))
        peft = config.get("adapter") in ("lora", "qlora")
        partial = bool(config.get("unfrozen_parameters"))
        kind = "dpo" if config.get("rl") else "sft"
        rl = bool(config.get("rl"))
        # Axolotl's own trainers add no input-grad hook for a partially frozen full model
        inputs_grad = not partial
    else:
        gc = bool(config.get("activation_checkpointing", config.get("gradient_checkpointing", True)))  # TRL: on
        peft = bool(config.get("use_peft")) or quantization is not None
        partial = False
        kind = launch.trainer
        rl = kind in RL_TRAINERS
        inputs_grad = True  # TRL hooks the inputs of PEFT models; full models have trainable embeddings
    tf = versions.get("transformers") or "0"
    from packaging.version import Version

    if Version(tf) >= Version("5.0.0"):
        inputs_grad = True  # the Trainer adds the input-grad hook itself
    return Facts(
        stage="init_end",
        versions=versions,
        gc_enabled=gc,
        use_reentrant=use_reentrant,
        use_reentrant_source="user" if given else "unset",
        kwargs_given=given,
        is_peft=peft,
        quantization=quantization,
        trainable_in_blocks=True,
        frozen_params=peft or partial or quantization is not None,
        inputs_require_grad=inputs_grad,
        use_cache=None,
        trainer_kind=kind,
        generates=kind in GENERATING_TRAINERS,
        rl_trainer=rl,
        world_size=max(1, launch.nproc),
        zero_stage=_zero_stage(config.get("deepspeed"), base_dir, path),
        fsdp=bool(config.get("fsdp")) or bool(fsdp_config),
        fsdp_activation_checkpointing=bool(parse_flag(fsdp_config.get("activation_checkpointing", False)))
        if isinstance(fsdp_config, dict)
        else False,
        ddp_find_unused_parameters=config.get("ddp_find_unused_parameters"),
        ddp_static_graph=config.get("ddp_static_graph"),
        model_is_pretrained=not peft,
        gc_flag_source="user"
        if "gradient_checkpointing" in config or "activation_checkpointing" in config
        else "trainer",
    )


def check(path: str, launch: Launch = Launch(), mode: Mode = "strict") -> tuple[Facts, list[Any]]:
    """Facts and decisions for the config at `path`."""
    facts = facts_from_config(load(path), path, launch)
    return facts, decide(facts, mode)


def render(path: str, facts: Facts, decisions: list[Any]) -> str:
    head = (
        f"{path}: transformers {facts.version('transformers')}, deepspeed {facts.version('deepspeed')}, "
        f"{facts.world_size} process(es), trainer {facts.trainer_kind}, checkpointing "
        f"{'on' if facts.gc_enabled else 'off'}, PEFT {facts.is_peft}, quantization {facts.quantization}, "
        f"ZeRO {facts.zero_stage}, FSDP {facts.fsdp}"
    )
    rows = [("rule", "action", "setting", "before -> after", "reason")]
    for d in decisions:
        rows.append((d.rule_id, d.action, d.setting, f"{d.before!r} -> {d.after!r}", d.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [head, ""]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    return "\n".join(lines)
