"""The former home of `trl-gc-plan` (now `cli.plan`): kept for console scripts installed before the move and for
`python -m trl_gc_plugin.plan_cli`."""

from __future__ import annotations

from .cli.plan import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
