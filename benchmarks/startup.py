"""Interpreter start-up cost of the installed plugin (issue: TRL_GC_PLUGIN auto-registration).

Builds the wheel, makes two venvs that see this environment's packages (one with the wheel installed, one without),
and times `python -c pass` in interleaved rounds:

- installed, TRL_GC_PLUGIN unset   vs  not installed      -> ratio of medians (target <= 1.01)
- installed, TRL_GC_PLUGIN=1       vs  installed, unset   -> added milliseconds (target <= 5 ms)
- installed, TRL_GC_PLUGIN=0       vs  installed, unset   -> added milliseconds (the `.pth` line tests only whether
  the variable is set; the start-up hook reads an off value and returns)

and, inside `python -S`, the time `site.main()` takes (the part a `.pth` file can add, without the process-spawn
noise of a whole start-up); and checks that with the variable set neither torch nor transformers is imported at start-up. It runs twice: in
bare venvs, and in venvs that also hold setuptools' `distutils-precedence.pth` (an import line, as most
environments with setuptools have), where the interpreter has already paid for its first `.pth` `exec`.
Instruction counts per candidate `.pth` line (deterministic, where these timings are not): `benchmarks/pth_cost.py`.

    .venv/bin/python benchmarks/startup.py [--runs 40] [--out benchmarks/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from startup_env import build_wheel, clean_env, make_venv

SITE_TIMER = ("import time; t = time.perf_counter(); import site; site.main(); "
              "print(time.perf_counter() - t)")


def once(python: Path, env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(wall time of `python -c pass`, time of the site-packages processing inside `python -S` + `site.main()`).

    The second isolates what a `.pth` file can cost from the process-spawn noise of the first."""
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, cwd=cwd, check=True)
    wall = time.perf_counter() - start
    site = subprocess.run([str(python), "-S", "-c", SITE_TIMER], env=env, cwd=cwd, check=True,
                          capture_output=True, text=True).stdout
    return wall, float(site)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup.json"))
    ns = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp) / "dist")
        for scenario, extra in (("bare_venv", None), ("venv_with_setuptools_pth", SETUPTOOLS_PTH)):
            results[scenario] = measure(Path(tmp) / scenario, wheel, extra, ns.runs)
    result = {"python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
              "runs_per_case": ns.runs, **results}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


SETUPTOOLS_PTH = ("import os; var = 'SETUPTOOLS_USE_DISTUTILS'; enabled = os.environ.get(var, 'local') == 'local'; "
                  "enabled and __import__('_distutils_hack').add_shim(); \n")


def measure(base: Path, wheel: Path, extra_pth: str | None, runs: int) -> dict[str, object]:
    base.mkdir(parents=True)
    cwd = str(base)
    with_plugin = make_venv(base / "with", wheel, extra_pth)
    without = make_venv(base / "without", None, extra_pth)
    unset, on, off = clean_env(), clean_env(TRL_GC_PLUGIN="1"), clean_env(TRL_GC_PLUGIN="0")
    cases = {"not_installed": (without, unset), "installed_unset": (with_plugin, unset),
             "installed_set": (with_plugin, on), "installed_off": (with_plugin, off)}
    for python, env in cases.values():  # warm the OS caches; a start-up that complains is no baseline
        err = subprocess.run([str(python), "-c", "pass"], env=env, cwd=cwd, capture_output=True, text=True).stderr
        if err:
            raise SystemExit(f"{python} prints on start-up:\n{err}")
    times: dict[str, list[float]] = {k: [] for k in cases}
    site: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(runs):  # interleaved, so drifts hit every case alike
        for name, (python, env) in cases.items():
            wall, site_s = once(python, env, cwd)
            times[name].append(wall)
            site[name].append(site_s)
    probe = subprocess.run(
        [str(with_plugin), "-c", "import sys; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"],
        env=on, cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    med = {k: statistics.median(v) for k, v in times.items()}
    site_med = {k: statistics.median(v) for k, v in site.items()}
    return {
        "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
        "median_site_processing_us": {k: round(v * 1e6) for k, v in site_med.items()},
        "site_added_us_installed_unset": round((site_med["installed_unset"] - site_med["not_installed"]) * 1e6),
        "site_added_us_when_set": round((site_med["installed_set"] - site_med["installed_unset"]) * 1e6),
        "site_added_us_when_off": round((site_med["installed_off"] - site_med["installed_unset"]) * 1e6),
        "ratio_installed_unset_vs_not_installed": round(med["installed_unset"] / med["not_installed"], 4),
        "added_ms_installed_unset": round((med["installed_unset"] - med["not_installed"]) * 1e3, 3),
        "added_ms_when_set": round((med["installed_set"] - med["installed_unset"]) * 1e3, 3),
        "added_ms_when_off": round((med["installed_off"] - med["installed_unset"]) * 1e3, 3),
        "heavy_modules_at_startup_when_set": probe,
    }


if __name__ == "__main__":
    main()
