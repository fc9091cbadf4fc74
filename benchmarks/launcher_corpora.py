"""`trl-gc-check` over the example configs and scripts the launchers ship (issue 39): does the check read what each
launcher runs, and say so where it cannot?

Reads the files from snapshots of the launchers' repositories (git directories without a work tree, as the project's
`fetch` tool leaves them; nothing of theirs is copied into this repository), checks each with `--parser model`, and
counts per launcher: files, read in full (`ok` / `refused`), read in part (`incomplete`: what was not read is named),
refused as unreadable (`error`, with its first line; a file that is no training config, such as an accelerate or
DeepSpeed config, lands here), and internal errors of the check (must be 0).

    python benchmarks/launcher_corpora.py --repo trl=/path/to/trl.git --repo axolotl=... [--out results/x.json]

`--repo NAME=GIT_DIR@REV` reads a tag or commit instead of HEAD (OpenRLHF's v0.11.0 and v0.9.10 were read too);
`--no-script-args` checks each corpus a second time with the scripts' own arguments (`"$@"`) read as none.

Selection: TRL `examples/cli_configs/*.yaml`; Axolotl `examples/**/*.y*ml`; LLaMA-Factory `examples/**/*.yaml`;
OpenRLHF `examples/scripts/*.sh`; verl `examples/**/*.sh` (issue 44). Writes benchmarks/results/launcher_corpora.json (per file: status, format, what was
not read, the error) and prints the counts.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SELECT = {
    "trl": ("examples/cli_configs/*.yaml",),
    "axolotl": ("examples/*.yml", "examples/*.yaml"),
    "llamafactory": ("examples/*.yaml",),
    "openrlhf": ("examples/scripts/*.sh",),
    "verl": ("examples/*.sh",),
}


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], capture_output=True, text=True, check=True).stdout


def files_of(repo: str, patterns: tuple[str, ...], rev: str = "HEAD") -> list[str]:
    names = _git(repo, "ls-tree", "-r", "--name-only", rev).splitlines()
    return sorted(n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns))


def check_corpus(name: str, repo: str, workdir: Path, rev: str = "HEAD", no_script_args: bool = False) -> dict:
    from trl_gc_plugin.configcheck.check import Launch, check_files

    commit = _git(repo, "rev-parse", f"{rev}^{{commit}}").strip()
    paths = []
    workdir = workdir / rev.replace("/", "_")
    for rel in files_of(repo, SELECT[name], rev):
        target = workdir / name / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(subprocess.run(["git", "--git-dir", repo, "show", f"{rev}:{rel}"], capture_output=True,
                                          check=True).stdout)
        paths.append(str(target))
    reports = check_files(paths, Launch(parser="model", no_script_args=no_script_args))
    files = []
    for path, report in zip(paths, reports, strict=True):
        files.append({
            "file": str(Path(path).relative_to(workdir / name)),
            "status": report.status,
            "format": report.format,
            "unread": report.unread,
            "error": report.error.replace(str(workdir / name) + "/", "").splitlines()[0][:300] if report.error else None,
        })
    internal = [f for f in files if f["error"] and "internal error in trl-gc-check" in f["error"]]
    counts = {
        "files": len(files),
        "read_in_full": sum(f["status"] in ("ok", "refused") for f in files),
        "of_which_refused": sum(f["status"] == "refused" for f in files),
        "read_in_part": sum(f["status"] == "incomplete" for f in files),
        "unreadable": sum(f["status"] == "error" for f in files),
        "internal_errors": len(internal),
    }
    return {"commit": commit, "counts": counts, "files": files}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", action="append", default=[], metavar="NAME=GIT_DIR",
                        help=f"a launcher's repository snapshot, NAME one of {', '.join(SELECT)}")
    parser.add_argument("--out", default=str(RESULTS / "launcher_corpora.json"))
    parser.add_argument("--no-script-args", action="store_true",
                        help='also check each corpus with the scripts\' own arguments ("$@") read as none (key NAME+no-args)')
    ns = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in ns.repo:
            name, _, where = spec.partition("=")
            repo, _, rev = where.partition("@")
            if name not in SELECT:
                parser.error(f"--repo {spec}: NAME must be one of {', '.join(SELECT)}")
            key = f"{name}@{rev}" if rev else name
            result[key] = check_corpus(name, repo, Path(tmp), rev or "HEAD")
            counts = result[key]["counts"]
            print(f"{key} @ {result[key]['commit'][:8]}: {json.dumps(counts)}", flush=True)
            if ns.no_script_args:
                result[key + "+no-args"] = check_corpus(name, repo, Path(tmp) / "no-args", rev or "HEAD", True)
                counts = result[key + "+no-args"]["counts"]
                print(f"{key}+no-args @ {result[key]['commit'][:8]}: {json.dumps(counts)}", flush=True)
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r["counts"]["internal_errors"] for r in result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
