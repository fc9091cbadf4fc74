"""Every GPU-only figure the project claims or owes, in one command (`make gpu-evidence`), sized for one H100 or H200
in under 8 minutes: each benchmark below runs in its own process with its own time limit, and what it wrote is
gathered into one file, `benchmarks/results/gpu-<date>.json` (or `--out-dir`), with the device and the versions.

- `planner_7b`: the memory planner at 7B-shaped blocks (hidden 4096, 4 layers, 1 x 4096 tokens, bf16): the share of
  full checkpointing's overhead each pick removes at the midway budget, and the planned run's peak against it
  (`planner_mixed.py --device cuda`).
- `selective_compiled`: selective and lean against full checkpointing on the small model, eager and compiled
  (`compile_selective.py --device cuda`).
- `parity_probe_1_5b`: the parity probe's peak above the model and its share of the first step on a 1.5B bf16 model
  (`parity_memory.py --cuda-1b`).
- `offloading`: transformers' `offload` and TRL's `activation_offloading` (where TRL is installed) against none and
  full checkpointing, with and without the plugin: peak and step time (`offloading.py --device cuda`).

Without a CUDA device it stops with exit code 2 and writes nothing. A benchmark that fails or runs out of time is
recorded as such (its last error line), and the others still run.

    python benchmarks/gpu_evidence.py [--out-dir DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
SHAPE_7B = {"hidden": 4096, "intermediate": 11008, "heads": 32, "layers": 4, "vocab": 32000, "batch": 1, "seq": 4096}

# name -> (arguments of the benchmark script, the file it writes under results/, seconds allowed)
RUNS: dict[str, tuple[list[str], str, int]] = {
    "planner_7b": (
        ["planner_mixed.py", "--device", "cuda", "--skip-70b", "--rounds", "3", "--shape", json.dumps(SHAPE_7B),
         "--out", "planner_mixed_cuda_7b.json"],
        "planner_mixed_cuda_7b.json",
        140,
    ),
    "selective_compiled": (["compile_selective.py", "--device", "cuda", "--rounds", "5"], "compile_selective_cuda.json", 100),
    "parity_probe_1_5b": (
        ["parity_memory.py", "--cuda-1b", "--out", str(RESULTS / "parity_memory_cuda.json")],
        "parity_memory_cuda.json",
        90,
    ),
    "offloading": (["offloading.py", "--device", "cuda", "--timeout", "40"], "offloading_cuda.json", 110),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--only", nargs="*", choices=list(RUNS), help="run these benchmarks only")
    ns = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu-evidence: no CUDA device here (torch.cuda.is_available() is False); nothing was run", file=sys.stderr)
        return 2
    versions = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    evidence = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "python": platform.python_version(),
        "versions": versions,
        "results": {},
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
    for name in ns.only or RUNS:
        args, written, limit = RUNS[name]
        target = RESULTS / written
        target.unlink(missing_ok=True)
        start = time.perf_counter()
        entry: dict = {"command": " ".join(["python", f"benchmarks/{args[0]}", *args[1:]]), "limit_s": limit}
        try:
            proc = subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]], capture_output=True, text=True,
                                  timeout=limit, env=env, cwd=HERE.parent)
            entry["exit_code"] = proc.returncode
            if proc.returncode != 0:
                lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
                entry["error"] = lines[-1][:400] if lines else f"exit code {proc.returncode}"
        except subprocess.TimeoutExpired:
            entry["error"] = f"timed out after {limit} s"
        entry["wall_s"] = round(time.perf_counter() - start, 1)
        if target.is_file():
            entry["result"] = json.loads(target.read_text())
        evidence["results"][name] = entry
        print(f"{name}: {entry.get('error', 'ok')} ({entry['wall_s']} s)", flush=True)
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-{evidence['date']}.json"
    path.write_text(json.dumps(evidence, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
