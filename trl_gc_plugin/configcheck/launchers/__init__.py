"""The launcher readers of `trl-gc-check`, one module each, each a `base.Launcher` (its `LAUNCHER`): a config read as
that launcher reads it, into a `read.common.Reading`. What they share (loading files, the shell, the side files a
config names, the launchers' own parsers in a subprocess) is in `configcheck.read`, which imports nothing of these.
`LAUNCHERS` is the registry, by format name, in the order `--format` lists them.
"""

from __future__ import annotations

from ..read.common import Config, NotTrainingConfig
from . import axolotl, llamafactory, openrlhf, training_args, trl, verl
from .base import Launcher

LAUNCHERS: dict[str, Launcher] = {
    launcher.name: launcher
    for launcher in (
        trl.LAUNCHER,
        axolotl.LAUNCHER,
        llamafactory.LAUNCHER,
        openrlhf.LAUNCHER,
        verl.LAUNCHER,
        training_args.LAUNCHER,
    )
}


def parse_command(path: str, text: str) -> Config:
    """The command line in the shell script or text file `path`: verl's where the text runs verl and no OpenRLHF
    entry point, else OpenRLHF's (`read.load.load` calls this for a command)."""
    if "openrlhf.cli." in text or not verl.mentions(text):
        return openrlhf.parse_command(path, text)
    try:
        return verl.parse_command(path, text)
    except NotTrainingConfig as exc:  # no verl command: an OpenRLHF one may come from a sourced file
        try:
            return openrlhf.parse_command(path, text)
        except NotTrainingConfig:
            raise exc from None
