"""Facts from the `config.json` of a local model directory the config names (the check downloads nothing: for a Hub
id they stay unknown): cross-layer KV sharing (`num_kv_shared_layers` > 0), a dropout > 0, and `model_type`; sub-configs
(`text_config`, ...) count as the model reads them.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .common import Reading

DROPOUT_KEYS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "activation_dropout",
)


def local_model_config(name: Any) -> tuple[str, dict[str, Any]] | None:
    """`(path, config)` of `name/config.json` when `name` is a local model directory with a readable config."""
    if not isinstance(name, str) or not name:
        return None
    file = os.path.join(name, "config.json")
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return None
    return (file, data) if isinstance(data, dict) else None


def _configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    nested = (v for v in config.values() if isinstance(v, dict))  # text_config, vision_config, ...
    return [config, *(v for v in nested if "model_type" in v or any(k in v for k in DROPOUT_KEYS))]


def read_model_facts(name: Any, key: str, reading: Reading) -> str | None:
    """Set `shared_state_layers` and `dropout` from the local model `name` (named by `key`); its `model_type`, or None
    when `name` is no local model directory."""
    found = local_model_config(name)
    if found is None:
        return None
    file, config = found
    configs = _configs(config)
    detail = f"{file} (the model `{key}` names)"
    shared = any(isinstance(c.get("num_kv_shared_layers"), int) and c["num_kv_shared_layers"] > 0 for c in configs)
    reading.set("shared_state_layers", shared, "model config", f"{detail}: num_kv_shared_layers")
    rates = [
        c[k]
        for c in configs
        for k in DROPOUT_KEYS
        if isinstance(c.get(k), (int, float)) and not isinstance(c.get(k), bool)
    ]
    reading.set("dropout", any(rate > 0 for rate in rates), "model config", f"{detail}: dropout probabilities")
    return config["model_type"] if isinstance(config.get("model_type"), str) else None
