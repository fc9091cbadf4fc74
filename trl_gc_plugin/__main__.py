"""`python -m trl_gc_plugin rules | check | plan ...`: the command line of `cli.main` (`trl-gc-check` is
`cli.check.check_main`, `trl-gc-plan` `cli.plan.main`)."""

from __future__ import annotations

from .cli.check import check_main
from .cli.main import main

__all__ = ["check_main", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
