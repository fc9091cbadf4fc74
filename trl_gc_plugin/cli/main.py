"""`python -m trl_gc_plugin rules [--markdown | --json | --update-readme PATH]`: print the rule table.
`python -m trl_gc_plugin check CONFIG... [--nproc N] [--json] ...`: check configs (also `trl-gc-check`); exit 0 all
fine, 1 strict mode or the launcher refuses one, 2 one cannot be read, has no recognised format, or an option is
invalid.
`python -m trl_gc_plugin plan CONFIG_OR_LAYOUT --batch-size B --seq-len S --budget 40GiB`: plan how much to checkpoint
(also `trl-gc-plan`); exit 0 a plan fits, 1 nothing fits, 2 unreadable input or an invalid option."""

from __future__ import annotations

import argparse
import sys

from ..core import table
from ..core.errors import UsageError
from .check import CHECK_DESCRIPTION, add_check_arguments, one_line_error, run_check, usage_error


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except UsageError as exc:  # `check`'s (`plan` turns its own into exit 2)
        return usage_error(exc)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["plan"]:  # the planner's command line has a parser of its own (also `trl-gc-plan`)
        from .plan import main as plan_main

        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m trl_gc_plugin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="plan how much to checkpoint within a memory budget (also trl-gc-plan; see plan -h)")
    rules = sub.add_parser("rules", help="print the rule table")
    fmt = rules.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="as the Markdown table of docs/rules.md")
    fmt.add_argument("--json", action="store_true", help="as JSON")
    fmt.add_argument(
        "--update-readme",
        metavar="PATH",
        help="rewrite docs/rules.md beside this README (and its generated block, if any)",
    )
    chk = sub.add_parser(
        "check",
        help="check training configs (TRL, Axolotl, LLaMA-Factory, TrainingArguments JSON) before launching",
        description=CHECK_DESCRIPTION,
    )
    add_check_arguments(chk)
    chk.error = lambda message: one_line_error(chk, message)  # type: ignore[method-assign]
    ns, extra = parser.parse_known_args(argv)
    if extra and ns.command == "check":
        one_line_error(chk, f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
