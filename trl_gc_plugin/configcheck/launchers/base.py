"""`Launcher`: what the check asks of every launcher reader. Each reader module (`trl`, `axolotl`, `llamafactory`,
`openrlhf`, `verl`, `training_args`) defines one subclass and its instance `LAUNCHER`; `check` and `detect` use only
this interface (the registry is `launchers.LAUNCHERS`), so no format is named outside its own module.
"""

from __future__ import annotations

from typing import Any

from ..read.common import Config, Context, LauncherRule, Reading


class Launcher:
    """One launcher's reader. `name`: the format (`--format`); `title`: how messages name the launcher; `markers`:
    keys only its configs use (empty: told otherwise, as a plain arguments file is by its fields); `strong_markers`:
    those that decide beside another launcher's markers; `read_keys`: the top-level keys it reads; `rules`: its own
    verdicts (`LauncherRule`). The hooks' defaults do nothing: a launcher without its own parser to run keeps the
    model's reading."""

    name: str = ""
    title: str = ""
    markers: frozenset[str] = frozenset()
    strong_markers: frozenset[str] = frozenset()
    read_keys: frozenset[str] = frozenset()
    rules: tuple[LauncherRule, ...] = ()

    def read(self, config: Config, ctx: Context) -> Reading:
        """The plugin's model of the launcher, on `config`."""
        raise NotImplementedError

    def no_own_parser(self) -> str | None:
        """Why `--parser launcher` cannot read this format here (None: it may)."""
        return None

    def native_job(self, config: Config, ctx: Context) -> dict[str, Any] | None:
        """The fields of the job the launcher's own parser runs on `config` in `_worker.py` (None: none runs)."""
        return None

    def with_native(self, config: Config, ctx: Context, reading: Reading, result: dict[str, Any]) -> Reading:
        """The reading once the launcher's own parser read `config` (`result`: the worker's answer)."""
        return reading

    def finish(self, config: Config, ctx: Context, reading: Reading) -> None:
        """What the launcher does after its parser (the model's or its own) read the file."""
