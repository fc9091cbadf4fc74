"""The mode policy, as one table: what the plugin does about a finding, given the mode and who chose what is at fault.

A `failure` is known to break training; a `repair` is an upstream inconsistency (drift, piled-up hooks). `explicit`:
the value at fault is the user's own (or of unknown origin). Where the plugin has nothing to switch (`can_fix=False`),
fix mode refuses as strict does; when another library owns checkpointing (`stands_back`) everything is reported.

| kind | explicit | strict | fix | warn / stands back |
|---|---|---|---|---|
| failure | yes | error | override (error without `can_fix`) | warn |
| failure | no | repair | repair | warn |
| repair | - | repair | repair | warn |
"""

from __future__ import annotations

from typing import Literal

from .decisions import Action
from .modes import Mode

Kind = Literal["failure", "repair"]

POLICY: dict[tuple[Kind, bool, Mode], Action] = {
    ("failure", True, "strict"): "error",
    ("failure", True, "fix"): "override",
    ("failure", True, "warn"): "warn",
    ("failure", False, "strict"): "repair",
    ("failure", False, "fix"): "repair",
    ("failure", False, "warn"): "warn",
    ("repair", True, "strict"): "repair",
    ("repair", True, "fix"): "repair",
    ("repair", True, "warn"): "warn",
    ("repair", False, "strict"): "repair",
    ("repair", False, "fix"): "repair",
    ("repair", False, "warn"): "warn",
}


def action_for(
    mode: Mode, kind: Kind = "failure", explicit: bool = True, stands_back: bool = False, can_fix: bool = True
) -> Action:
    """The action for a finding (the table in the module docstring).

    Example:
        >>> action_for("fix", explicit=True), action_for("fix", explicit=True, can_fix=False)
        ('override', 'error')
    """
    if stands_back:
        return "warn"
    if not can_fix and mode == "fix":
        mode = "strict"
    return POLICY[(kind, explicit, mode)]


def refused(mode: Mode) -> Action:
    """What an explicit choice known to break training becomes: `error` (strict), `override` (fix), `warn`."""
    return action_for(mode, "failure", explicit=True)
