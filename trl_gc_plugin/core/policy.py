"""The mode policy, as one table: what the plugin does about a finding, given the mode and who chose what is at fault.

Every decision of the engine and every runtime check goes through `action_for`; nothing else reads the mode to pick
an action. A finding is one of two kinds:

- `failure`: the setup is known to break training (a rule's `require`, a refusal at run time). The user's own choice
  is refused in strict mode and overridden, loudly, in fix mode; a value nobody chose (unset, or written by a trainer
  or by the plugin) is repaired. Where the plugin has nothing it could switch (`can_fix=False`: a second forward
  before the backward), fix mode refuses as strict does.
- `repair`: an upstream inconsistency the plugin puts right (drift, piled-up hooks, a stale model): repaired.

In warn mode, and when another library owns checkpointing (the plugin stands back: Unsloth, FSDP's own), everything
is reported and nothing changed.

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
    """The action for a finding (see the table in the module docstring).

    Args:
        mode: `strict`, `fix` or `warn`.
        kind: `failure` (known to break training) or `repair` (an upstream inconsistency).
        explicit: the value at fault is the user's own choice (or of unknown origin).
        stands_back: another library owns checkpointing: report only.
        can_fix: the plugin has something to switch; without it, fix mode refuses as strict does.

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
