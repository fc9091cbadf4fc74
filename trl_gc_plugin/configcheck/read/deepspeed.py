"""The DeepSpeed config a training config names, read by `core.deepspeed_config` (as the running plugin reads it).
A relative path is looked for where the launch runs, then next to the config (said), then in the launcher's table of
the configs it ships, which examples name without shipping."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core.deepspeed_config import deepspeed_facts
from .common import ConfigError, Origin, Reading, find_beside, short, type_name, where
from .load import load_json_file


@dataclass(frozen=True)
class DeepSpeedConfig:
    """`overlap_comm` is None for a shipped config that was not read (`origin` `launcher default`); `note` what the
    output must say."""

    stage: int
    activation_checkpointing: bool
    origin: Origin
    detail: str
    note: str = ""
    overlap_comm: bool | None = None

    def set_facts(self, reading: Reading) -> None:
        for name, value, key in (
            ("zero_stage", self.stage, "zero_optimization.stage"),
            ("deepspeed_activation_checkpointing", self.activation_checkpointing, "activation_checkpointing"),
            ("zero_overlap_comm", self.overlap_comm, "zero_optimization.overlap_comm"),
        ):
            reading.set(name, value, self.origin, f"{self.detail}: {key}")
        if self.note:
            reading.notes.append(self.note)


def read_deepspeed(
    value: Any,
    path: str,
    key: str,
    base_dir: str,
    bundled: Mapping[str, int],
    bundled_where: str,
    lines: Mapping[str, int] | None = None,
) -> DeepSpeedConfig:
    """The DeepSpeed config `value` (a mapping or a path) of `key`; `bundled` maps the launcher's shipped configs to
    their ZeRO stage, `bundled_where` says where it ships them."""
    if isinstance(value, dict):
        return _parse(value, f"{key} (inline)", path, key, f"key {key!r} (inline mapping)")
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{where(path, key, lines)}: expected a path to a DeepSpeed JSON file or a mapping, got {type_name(value)} "
            f"{short(value)}"
        )
    file = find_beside(value, base_dir, os.path.exists)
    if file is not None:
        if not os.path.isfile(file):
            raise ConfigError(f"{where(path, key, lines)}: {file} is not a regular file")
        note = ""
        if file != value:
            note = (
                f"{key}: {value!r} is not in the current directory {os.getcwd()!r}; read it next to the config "
                f"({file}). The launcher reads it relative to the directory you launch from."
            )
        return _parse(load_json_file(file, f"DeepSpeed config ({key!r})"), file, path, key, file, note)
    name = os.path.basename(value)
    if name in bundled:
        stage = bundled[name]
        return DeepSpeedConfig(
            stage=stage,
            activation_checkpointing=False,
            origin="launcher default",
            detail=f"{value!r} is not on disk here: the launcher's shipped {bundled_where}{name}",
            note=(
                f"{key}: {value!r} was not found (current directory or next to the config); read as the launcher's "
                f"shipped {bundled_where}{name}, ZeRO stage {stage}. Copy it where the launch runs."
            ),
        )
    raise ConfigError(
        f"{where(path, key, lines)}: DeepSpeed config {value!r} not found (looked in the current directory "
        f"{os.getcwd()!r}, as the launcher does, and next to the config)"
    )


def _parse(data: Any, label: str, path: str, key: str, detail: str, note: str = "") -> DeepSpeedConfig:
    if not isinstance(data, dict):
        raise ConfigError(
            f"DeepSpeed config {label} ({path}, key {key!r}): must be a JSON object, not {type_name(data)}"
        )
    facts = deepspeed_facts(data)
    if facts.problems or facts.stage is None:
        raise ConfigError(f"DeepSpeed config {label}: " + "; ".join(facts.problems))
    if facts.stage_auto:
        auto = (
            f"{label}: zero_optimization.stage is 'auto': read as {facts.stage}, the stage accelerate fills in "
            "(ACCELERATE_DEEPSPEED_ZERO_STAGE, else 2)."
        )
        note = f"{note} {auto}" if note else auto
    return DeepSpeedConfig(
        stage=facts.stage,
        activation_checkpointing=facts.activation_checkpointing,
        overlap_comm=facts.overlap_comm,
        origin="deepspeed config",
        detail=detail,
        note=note,
    )
