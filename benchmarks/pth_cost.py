"""What a `.pth` line costs at interpreter start-up, counted in instructions (callgrind), per candidate line.

Python's `site` module reads every `.pth` file in site-packages and `exec`s each line that starts with `import`:
every `python` process of the environment pays for the plugin's line, whether it trains or not. Wall-clock timing
of a 10-15 ms start-up cannot resolve a 0.1 ms difference on a shared machine (`benchmarks/startup.py`); instruction
counts can, and they are deterministic. For each candidate this builds a bare venv (`python -m venv --without-pip`,
so no other `.pth` file), puts the package's stdlib-only start-up modules (`trl_gc_plugin/__init__.py`,
`_startup.py`, `_flags.py`, compiled to `.pyc` as pip does) and the candidate's files in its site-packages, and
counts the instructions of `python -c pass` under `valgrind --tool=callgrind` with a fixed environment
(`PYTHONHASHSEED=0`). Every venv holds the same package copy: only the start-up files differ. `--runs` counts per
case; the result keeps each run's count, whether they were identical, the median, and the difference to the venv
without a `.pth` file and to the `import os` line (the floor of any executable `.pth` line). It also records which
`trl_gc_plugin` modules each case imports at start-up (a plain run).

    .venv/bin/python benchmarks/pth_cost.py [--runs 3] [--python /path/to/python3.12 ...] \
        [--out benchmarks/results/pth_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = (ROOT / "startup" / "trl_gc_plugin.pth").read_text()
PACKAGE_FILES = ("__init__.py", "_startup.py", "_base/__init__.py", "_base/flags.py")  # start-up's; stdlib only

PREVIOUS = ('import os; os.environ.get("TRL_GC_PLUGIN", "").strip().lower() not in ("", "0", "false", "no", "off") '
            'and __import__("trl_gc_plugin._startup")._startup.run()\n')
TINY_MODULE = ('from os import environ\n\nif "TRL_GC_PLUGIN" in environ:\n'
               '    __import__("trl_gc_plugin._startup")\n')

# (name, what it shows, files put in site-packages beyond the package, extra environments besides "unset")
CANDIDATES: list[tuple[str, str, dict[str, str], tuple[str, ...]]] = [
    ("no .pth", "baseline", {}, ()),
    ("comment-only .pth", "reading a .pth file, nothing executed", {"p.pth": "# trl_gc_plugin\n"}, ()),
    ("import os", "the floor of any executable .pth line", {"p.pth": "import os\n"}, ()),
    ("import os, two .pth files", "a second executable line pays in full: no first-exec warm-up to share",
     {"p.pth": "import os\n", "q.pth": "import os\n"}, ()),
    ("previous line (0.1.0)", "off-values checked in the line", {"p.pth": PREVIOUS}, ("0",)),
    ("check only", "the `in os.environ` test, nothing after it",
     {"p.pth": 'import os;"TRL_GC_PLUGIN"in os.environ\n'}, ()),
    ("check, ._startup.run(), spaced", "the call spelled out",
     {"p.pth": 'import os; "TRL_GC_PLUGIN" in os.environ and __import__("trl_gc_plugin._startup")._startup.run()\n'},
     ()),
    ("check, ._startup.run()", "the same without blanks",
     {"p.pth": 'import os;"TRL_GC_PLUGIN"in os.environ and __import__("trl_gc_plugin._startup")._startup.run()\n'},
     ()),
    ("os.getenv", "a call instead of `in`",
     {"p.pth": 'import os;os.getenv("TRL_GC_PLUGIN")and __import__("trl_gc_plugin._startup")\n'}, ()),
    ("conditional expression", "`x if c else 0` instead of `and`",
     {"p.pth": 'import os;__import__("trl_gc_plugin._startup")if"TRL_GC_PLUGIN"in os.environ else 0\n'}, ()),
    ("chained comparison", "`a in b != c` instead of `and`",
     {"p.pth": 'import os;"TRL_GC_PLUGIN"in os.environ!=__import__("trl_gc_plugin._startup")\n'}, ()),
    ("shipped", "startup/trl_gc_plugin.pth: the check, and importing `_startup` runs it",
     {"p.pth": SHIPPED}, ("0", "1", "maybe")),
    ("tiny top-level module", "`import <module>` at the site-packages root; the module tests the variable",
     {"p.pth": "import _trl_gc_plugin_pth\n", "_trl_gc_plugin_pth.py": TINY_MODULE}, ()),
    ("package submodule", "`import trl_gc_plugin._startup`: the package and `_startup` imported every start-up",
     {"p.pth": "import trl_gc_plugin._startup\n"}, ()),
    ("import os + long comment", "120 more characters for the tokenizer only",
     {"p.pth": "import os  # " + "x" * 120 + "\n"}, ()),
    ("import os + long string", "120 more characters in one constant",
     {"p.pth": 'import os;"' + "x" * 120 + '"\n'}, ()),
    ("import os + unexecuted expression", "tokens the parser and compiler handle but nothing runs",
     {"p.pth": 'import os;0 and __import__("x").a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p\n'}, ()),
    # what each part of the shipped line costs (issue 46: is +1.0% reachable?)
    ("import os + a second statement", "`;0`: the least a test of anything adds", {"p.pth": "import os;0\n"}, ()),
    ("import os + `0 and x`", "a short-circuit with nothing run after it", {"p.pth": "import os;0 and x\n"}, ()),
    ("import os + the import, never run", "the shipped line with a constant false test",
     {"p.pth": 'import os;0 and __import__("trl_gc_plugin._startup")\n'}, ()),
    ("os.environ._data", "the bytes-keyed dict under os.environ (POSIX; never true on Windows, whose keys are str)",
     {"p.pth": 'import os;b"TRL_GC_PLUGIN"in os.environ._data and __import__("trl_gc_plugin._startup")\n'}, ()),
    ("posix.environ", "the C-level environment dict (no `posix` module on Windows: an error every start-up there)",
     {"p.pth": 'import posix;b"TRL_GC_PLUGIN"in posix.environ and __import__("trl_gc_plugin._startup")\n'}, ()),
]

BASELINE, FLOOR = "no .pth", "import os"
ENV = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
IMPORTED = "import sys; print(sorted(m for m in sys.modules if m.startswith('trl_gc_plugin')))"


def make_venv(python: str, path: Path, files: dict[str, str], bare: bool = True) -> Path:
    subprocess.run([python, "-m", "venv", *(["--without-pip"] if bare else []), str(path)], check=True)
    venv_python = path / "bin" / "python"
    purelib = Path(subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    (purelib / "trl_gc_plugin").mkdir()
    for name in PACKAGE_FILES:
        (purelib / "trl_gc_plugin" / name).parent.mkdir(exist_ok=True)
        shutil.copyfile(ROOT / "trl_gc_plugin" / name, purelib / "trl_gc_plugin" / name)
    for name, text in files.items():
        (purelib / name).write_text(text)
    subprocess.run([str(venv_python), "-m", "compileall", "-q", str(purelib)], check=True)  # as pip does
    return venv_python


def count(python: Path, env: dict[str, str], cwd: str) -> int:
    err = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", str(python), "-c", "pass"],
                         env=env, cwd=cwd, capture_output=True, text=True, check=True).stderr
    match = re.search(r"Collected : (\d+)", err)
    if match is None:
        raise SystemExit(f"no instruction count in callgrind's output:\n{err}")
    return int(match.group(1))


DEFAULT_VENV_CASES = ("no .pth", "import os", "check only", "shipped")
"""`--venv default`: the cases measured in venvs as `python -m venv` builds them (pip, and on Python <= 3.11
setuptools, whose `distutils-precedence.pth` runs its own line at every start-up): the baseline a user's environment
starts from, against the bare venv's strictest one."""


def measure(python: str, runs: int, tmp: Path, bare: bool = True) -> dict[str, object]:
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], check=True,
                             capture_output=True, text=True).stdout.strip()
    cases = []
    for i, (name, shows, files, envs) in enumerate(CANDIDATES):
        if not bare and name not in DEFAULT_VENV_CASES:
            continue
        venv_python = make_venv(python, tmp / f"v{version}" / f"c{i:02d}", files, bare)  # same-length paths
        for value in (None, *envs):
            env = dict(ENV) if value is None else {**ENV, "TRL_GC_PLUGIN": value}
            counts = [count(venv_python, env, str(tmp)) for _ in range(runs)]
            plain = subprocess.run([str(venv_python), "-c", IMPORTED], env=env, cwd=str(tmp), capture_output=True,
                                   text=True, check=True)
            cases.append({"name": name, "shows": shows, "TRL_GC_PLUGIN": value, "files": files,
                          "instructions": counts, "identical": len(set(counts)) == 1,
                          "median": int(statistics.median(counts)),
                          "imported_at_start_up": plain.stdout.strip(), "stderr": plain.stderr})
            print(f"  {version} {name} [{value}]: {counts}", file=sys.stderr, flush=True)
    unset = {c["name"]: c["median"] for c in cases if c["TRL_GC_PLUGIN"] is None}
    base, floor = unset[BASELINE], unset[FLOOR]
    for case in cases:
        case["added"] = case["median"] - base
        case["added_percent"] = round(100 * (case["median"] - base) / base, 3)
        case["above_import_os"] = case["median"] - floor
    return {"python": version, "executable": python, "venv": "bare" if bare else "default",
            "python_c_pass_instructions": base, "cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--python", action="append", help="interpreter(s) to build the venvs with (default: this one)")
    parser.add_argument("--venv", choices=("bare", "default"), default="bare",
                        help="bare: `--without-pip` (no other .pth file; the target's measure); default: as `python -m "
                        "venv` builds it (pth_cost_default_venv.json)")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    bare = ns.venv == "bare"
    ns.out = ns.out or str(Path(__file__).parent / "results" / ("pth_cost.json" if bare else "pth_cost_default_venv.json"))
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    valgrind = subprocess.run(["valgrind", "--version"], check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        interpreters = [measure(python, ns.runs, Path(tmp), bare) for python in ns.python or [sys.executable]]
    result = {
        "method": (
            "valgrind --tool=callgrind instruction counts ('Collected') of `python -c pass`, whole process, in "
            + ("bare venvs (python -m venv --without-pip)" if bare else "venvs as `python -m venv` builds them")
            + " that differ only by the candidate's start-up files; environment "
            "PATH=/usr/bin:/bin PYTHONHASHSEED=0 (+ TRL_GC_PLUGIN where given); median of `runs` counts; added = "
            "median - the venv without a .pth; above_import_os = median - the `import os` line's"
        ),
        "valgrind": valgrind, "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "runs": ns.runs,
        "interpreters": interpreters,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    for interp in interpreters:
        print(f"Python {interp['python']}: python -c pass = {interp['python_c_pass_instructions']:,} instructions")
        for c in interp["cases"]:
            env = "" if c["TRL_GC_PLUGIN"] is None else f" [TRL_GC_PLUGIN={c['TRL_GC_PLUGIN']}]"
            print(f"  {c['added']:>+10,} {c['added_percent']:>+7.2f}% {c['above_import_os']:>+10,}  "
                  f"{c['name']}{env}{'' if c['identical'] else '  (runs differ)'}")


if __name__ == "__main__":
    main()
