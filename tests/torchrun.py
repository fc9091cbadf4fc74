"""Run a scenario script under `torchrun --nproc_per_node 2` (gloo, CPU) and collect what each rank wrote.

The scripts (`ddp_scenarios.py`, `fsdp_scenarios.py`, `zero12_scenarios.py`) append one JSON line per scenario to
`OUTDIR/results-rank<R>.jsonl` (not stdout, where the ranks interleave) with `write_results`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port nothing listens on now (two CI jobs or pytest workers on one machine must not share one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_scenarios(script: str, out: Path, scenarios: list[str], port: int | None = None,
                  env: dict[str, str] | None = None, timeout: int = 900) -> dict[str, dict[int, Any]]:
    """{scenario: {rank: result}} for `scenarios` run by `tests/<script>` on 2 ranks (on a free port unless `port`);
    fails with the stderr tail when the launch fails or a rank misses a scenario."""
    port = port or free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         str(Path(__file__).with_name(script)), str(out), *scenarios],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    lines = [json.loads(line) for f in sorted(out.glob("results-rank*.jsonl")) for line in f.read_text().splitlines()]
    done = {(item["scenario"], item["rank"]) for item in lines}
    missing = [f"{s}@{r}" for s in scenarios for r in (0, 1) if (s, r) not in done]
    assert proc.returncode == 0 and not missing, (
        f"exit code {proc.returncode}; no result for {missing or 'none'}\n{proc.stderr[-4000:]}")
    by: dict[str, dict[int, Any]] = {}
    for item in lines:
        by.setdefault(item["scenario"], {})[item["rank"]] = item
    return by


def write_results(out: str, scenarios: list[str], run: Callable[[str, str], Any]) -> None:
    """Rank side: `run(out, scenario)` for each scenario, one JSON line each in `out/results-rank<RANK>.jsonl`;
    `os.environ` restored after each (TrainingArguments and the Accelerator write ACCELERATE_*, FSDP_* variables),
    ranks kept in step once a process group exists; then the rank ends (`finish`)."""
    import torch.distributed as dist

    with open(os.path.join(out, f"results-rank{os.environ['RANK']}.jsonl"), "a", encoding="utf-8") as fh:
        for scenario in scenarios:
            saved = dict(os.environ)
            try:
                fh.write(json.dumps(run(out, scenario), default=repr) + "\n")
            finally:
                os.environ.clear()
                os.environ.update(saved)
            fh.flush()
            if dist.is_initialized():
                dist.barrier()
    finish()


def finish() -> None:
    """End the rank with exit code 0 once its results are written, without the interpreter's teardown: there, C++
    threads of gloo / DeepSpeed left running abort the process now and then ("terminate called without an active
    exception", SIGABRT, pytorch #190489; seen in CI and here after every result was written, with or without
    `destroy_process_group`). Ranks first wait for each other, so that no collective is still in flight."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
