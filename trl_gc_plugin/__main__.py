"""`python -m trl_gc_plugin rules [--markdown | --json]`: print the rule table."""

from __future__ import annotations

import argparse
import sys

from . import table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trl_gc_plugin", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rules = sub.add_parser("rules", help="print the rule table")
    fmt = rules.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    fmt.add_argument("--json", action="store_true", help="as JSON")
    fmt.add_argument("--update-readme", metavar="PATH", help="rewrite the generated rule table in this README")
    ns = parser.parse_args(argv)
    if ns.command == "rules" and ns.update_readme:
        changed = table.update_readme(ns.update_readme)
        sys.stdout.write(f"{ns.update_readme}: {'updated' if changed else 'already up to date'}\n")
    elif ns.command == "rules":
        out = table.markdown() if ns.markdown else table.as_json() if ns.json else table.text()
        sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
