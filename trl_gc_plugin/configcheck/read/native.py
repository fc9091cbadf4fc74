"""Run `_worker.py` for a batch of configs in one subprocess (the launchers' imports are paid once), with a time
limit, no distributed variables (with them `TrainingArguments` waits for other ranks), no GPU and an offline Hub; a
config it did not finish is read by the plugin's model instead, which the output says.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

DISTRIBUTED_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NODE_RANK",
        "PMI_SIZE",
        "PMI_RANK",
        "TRL_GC_PLUGIN",
        "TRL_GC_PLUGIN_MODE",
        "CUDA_VISIBLE_DEVICES",
    }
)
DISTRIBUTED_PREFIXES = (
    "ACCELERATE_",
    "FSDP_",
    "OMPI_COMM_WORLD_",
    "MV2_COMM_WORLD_",
    "TORCHELASTIC_",
    "PMIX_",
    "SLURM_",
)


def importable(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def clean_environment() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES and not k.startswith(DISTRIBUTED_PREFIXES)
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    # the folder that holds the `trl_gc_plugin` package, so the worker imports this copy (a checkout included)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def run(jobs: list[dict[str, Any]], timeout: float) -> dict[int, dict[str, Any]]:
    """The worker's result by job id; a job it did not finish gets `{"ok": False, "kind": "environment"}`."""
    if not jobs:
        return {}
    results: dict[int, dict[str, Any]] = {}
    reason = ""
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trl_gc_plugin.configcheck.read._worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=clean_environment(),
            text=True,
        )
    except OSError as exc:
        proc, reason = None, f"could not start {sys.executable}: {exc}"
    if proc is not None:
        try:
            out, err = proc.communicate(json.dumps({"jobs": jobs}), timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            reason = f"the launcher's parser did not finish within {timeout:g} s (--timeout)"
        for line in out.splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and isinstance(item.get("id"), int):
                results[item["id"]] = item
        if not reason and proc.returncode:
            tail = [line for line in err.splitlines() if line.strip()][-1:] or [f"exit status {proc.returncode}"]
            reason = f"the launcher's parser process failed: {tail[0][:200]}"
    for job in jobs:
        results.setdefault(
            job["id"], {"id": job["id"], "ok": False, "kind": "environment", "message": reason or "no result"}
        )
    return results
