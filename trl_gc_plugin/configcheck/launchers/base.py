"""`Launcher`: what the check asks of every launcher reader. Each reader module (`trl`, `axolotl`, `llamafactory`,
`openrlhf`, `verl`, `training_args`) defines one subclass and its instance `LAUNCHER`; `check` and `detect` use only
this interface (the registry is `launchers.LAUNCHERS`), so no format is named outside its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..read.common import Config, Context, LauncherRule, Reading


class Launcher:
    """One launcher's reader. `name`: the format (`--format`); `title`: how messages name the launcher; `markers`:
    keys only its configs use (empty: told otherwise, as a plain arguments file is by its fields); `strong_markers`:
    those that decide beside another launcher's markers; `read_keys`: the top-level keys it reads; `rules`: its own
    verdicts (`LauncherRule`); `read`: the plugin's model of the launcher, on a config; `no_parser`: why `--parser
    launcher` cannot read this format (None: it may). The hooks' defaults do nothing: a launcher without its own parser
    to run keeps the model's reading; one that has one subclasses and fills them."""

    def __init__(
        self,
        name: str,
        title: str,
        read: Callable[[Config, Context], Reading],
        *,
        markers: frozenset[str] = frozenset(),
        strong_markers: frozenset[str] = frozenset(),
        read_keys: frozenset[str] = frozenset(),
        rules: tuple[LauncherRule, ...] = (),
        no_parser: str | None = None,
    ) -> None:
        self.name, self.title, self.read = name, title, read
        self.markers, self.strong_markers, self.read_keys, self.rules = markers, strong_markers, read_keys, rules
        self.no_parser = no_parser

    def no_own_parser(self) -> str | None:
        """Why `--parser launcher` cannot read this format here (None: it may)."""
        return self.no_parser

    def native_job(self, config: Config, ctx: Context) -> dict[str, Any] | None:
        """The fields of the job the launcher's own parser runs on `config` in `_worker.py` (None: none runs)."""
        return None

    def with_native(self, config: Config, ctx: Context, reading: Reading, result: dict[str, Any]) -> Reading:
        """The reading once the launcher's own parser read `config` (`result`: the worker's answer)."""
        return reading

    def finish(self, config: Config, ctx: Context, reading: Reading) -> None:
        """What the launcher does after its parser (the model's or its own) read the file."""
