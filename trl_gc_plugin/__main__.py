"""`python -m trl_gc_plugin rules [--markdown | --json | --update-readme PATH]`: print the rule table.
`python -m trl_gc_plugin check CONFIG [--nproc N] [--transformers-version V] ...`: check a config (also
`trl-gc-check`); exit 0 fine, 1 refused in strict mode, 2 unreadable."""

from __future__ import annotations

import argparse
import sys

from . import table


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a TRL CLI config (YAML/JSON) or an Axolotl YAML")
    parser.add_argument("--nproc", type=int, default=1, help="processes the launch will start (default 1)")
    parser.add_argument("--trainer", default="sft", help="TRL trainer the config is for: sft, dpo, grpo, ...")
    parser.add_argument("--mode", default="strict", choices=["strict", "fix", "warn"])
    for package in ("transformers", "trl", "peft", "deepspeed", "torch"):
        parser.add_argument(
            f"--{package}-version",
            dest=f"v_{package}",
            metavar="VERSION",
            help=f"check for this {package} release instead of the installed one",
        )


def run_check(ns: argparse.Namespace) -> int:
    """Exit 0: fine; 1: strict mode would refuse it; 2: the config cannot be read."""
    from .check import ConfigError, Launch, check, render

    versions = tuple(
        (p, getattr(ns, f"v_{p}"))
        for p in ("transformers", "trl", "peft", "deepspeed", "torch")
        if getattr(ns, f"v_{p}")
    )
    try:
        facts, decisions = check(ns.config, Launch(nproc=ns.nproc, trainer=ns.trainer, versions=versions), ns.mode)
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(render(ns.config, facts, decisions) + "\n")
    return 1 if any(d.action == "error" for d in decisions) else 0


def check_main() -> int:
    """The `trl-gc-check` console script."""
    parser = argparse.ArgumentParser(prog="trl-gc-check", description="check a TRL or Axolotl config before launching")
    add_check_arguments(parser)
    return run_check(parser.parse_args())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_gc_plugin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rules = sub.add_parser("rules", help="print the rule table")
    fmt = rules.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    fmt.add_argument("--json", action="store_true", help="as JSON")
    fmt.add_argument("--update-readme", metavar="PATH", help="rewrite the generated rule table in this README")
    chk = sub.add_parser("check", help="check a TRL or Axolotl config before launching")
    add_check_arguments(chk)
    ns = parser.parse_args(argv)
    if ns.command == "check":
        return run_check(ns)
    if ns.command == "rules" and ns.update_readme:
        changed = table.update_readme(ns.update_readme)
        sys.stdout.write(f"{ns.update_readme}: {'updated' if changed else 'already up to date'}\n")
    elif ns.command == "rules":
        out = table.markdown() if ns.markdown else table.as_json() if ns.json else table.text()
        sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
