"""`trl-gc-check` outputs written to a directory, to diff before and after a change that must not change them (issue 45:
the restructuring of `configcheck` and the CLIs).

    python benchmarks/check_json_snapshot.py OUT_DIR [--repo NAME=GIT_DIR ...] [--text]

Each file of `tests/data` is checked alone (`OUT_DIR/data/FILE.json`: stdout, then stderr and the exit status), and
each launcher corpus (the selection of `launcher_corpora.py`, read from a repository snapshot) is checked in one run
(`OUT_DIR/corpora/NAME.json`), with the default parser. The check runs in `python -m trl_gc_plugin check` (the
interpreter running this script, its `PYTHONPATH`), from the folder of the files, with relative paths, so the output
does not depend on where the files lie. `--text` writes the text output beside (`.txt`). Compare two runs with
`diff -r`. Command lines that exit 2 (options refused) and the planner's are run too (`OUT_DIR/cases`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from launcher_corpora import SELECT, files_of

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


CASES = {
    "bad-nproc": ["check", "--nproc", "0", "trl_sft_lora.yaml"],
    "bad-format": ["check", "--format", "bogus", "trl_sft_lora.yaml"],
    "bad-timeout": ["check", "--timeout", "-1", "trl_sft_lora.yaml"],
    "bad-version": ["check", "--deepspeed-version", "x.y", "trl_sft_lora.yaml"],
    "bad-accelerate": ["check", "--accelerate-config", "nope", "trl_sft_lora.yaml"],
    "bad-option": ["check", "--bogus", "trl_sft_lora.yaml"],
    "missing-file": ["check", "no_such_file.yaml"],
    "launcher-parser": ["check", "--parser", "launcher", "axolotl_sft_lora.yml", "lf_lora_sft.yaml"],
    "brief": ["check", "--brief", "trl_sft_lora_reentrant.yaml", "axolotl_qlora_zero3.yml", "malformed.yaml"],
    "skip-other": ["check", "--skip-other-files", "zero3.json", "accelerate_fsdp2.yaml", "trl_sft_lora.yaml"],
    "plan-malformed": ["plan", "plan_malformed.json", "--batch-size", "1", "--seq-len", "8", "--budget", "1GiB"],
    "plan-bad-budget": ["plan", "plan_tiny.json", "--batch-size", "1", "--seq-len", "8", "--budget", "lots"],
    "plan-accelerate": [
        "plan",
        "plan_tiny.json",
        "--batch-size",
        "1",
        "--seq-len",
        "8",
        "--budget",
        "1GiB",
        "--accelerate-config",
        "malformed.yaml",
    ],
    "plan-tiny": ["plan", "plan_tiny.json", "--batch-size", "1", "--seq-len", "8", "--budget", "1GiB"],
}
"""Command lines run from `tests/data` (`OUT_DIR/cases/NAME.txt`): the options refused (exit 2) and the planner."""


def run(cwd: Path, argv: list[str], out: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trl_gc_plugin", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
    )
    out.write_text(f"{proc.stdout}\n--- stderr\n{proc.stderr}\n--- exit status {proc.returncode}\n")


def run_check(cwd: Path, files: list[str], out: Path, text: bool) -> None:
    variants = [("json", ["--json"])] + ([("txt", [])] if text else [])
    for suffix, flags in variants:
        proc = subprocess.run(
            [sys.executable, "-m", "trl_gc_plugin", "check", *flags, *files],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "120"},
        )
        out.with_name(f"{out.name}.{suffix}").write_text(
            f"{proc.stdout}\n--- stderr\n{proc.stderr}\n--- exit status {proc.returncode}\n"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder to write the outputs to (created)")
    parser.add_argument(
        "--repo",
        action="append",
        default=[],
        metavar="NAME=GIT_DIR",
        help=f"a launcher's repository snapshot, NAME one of {', '.join(SELECT)}",
    )
    parser.add_argument("--text", action="store_true", help="also write the text output")
    ns = parser.parse_args()
    out = Path(ns.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in DATA.iterdir() if p.is_file()):
        run_check(DATA, [path.name], out / "data" / path.name, ns.text)
    (out / "cases").mkdir(exist_ok=True)
    for name, argv in CASES.items():
        run(DATA, argv, out / "cases" / f"{name}.txt")
    if ns.repo:
        (out / "corpora").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in ns.repo:
            name, _, repo = spec.partition("=")
            if name not in SELECT:
                parser.error(f"--repo {spec}: NAME must be one of {', '.join(SELECT)}")
            where = Path(tmp) / name
            files = files_of(repo, SELECT[name])
            for rel in files:
                (where / rel).parent.mkdir(parents=True, exist_ok=True)
                (where / rel).write_bytes(
                    subprocess.run(
                        ["git", "--git-dir", repo, "show", f"HEAD:{rel}"], capture_output=True, check=True
                    ).stdout
                )
            run_check(where, files, out / "corpora" / name, ns.text)
            print(f"{name}: {len(files)} files", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
