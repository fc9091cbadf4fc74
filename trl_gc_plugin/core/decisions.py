"""The `Decision` record (the one structured thing the plugin produces), and the `gc_decisions.json` file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Action = Literal["default", "override", "repair", "warn", "error", "none"]
Level = Literal["info", "warning", "error"]

DECISIONS_FILE = "gc_decisions.json"


def level_of(action: Action, rule_level: Level = "warning") -> Level:
    """Refusals are errors; overrides and warn-mode findings warnings; repairs take their rule's level; the rest
    (defaults filled, nothing to do) information."""
    if action == "error":
        return "error"
    if action in ("override", "warn"):
        return "warning"
    if action == "repair":
        return rule_level
    return "info"


@dataclass(frozen=True)
class Decision:
    """One decision of the plugin about one setting. `action`: `default` (filled a value nobody set), `override`
    (replaced an explicit value, fix mode), `repair` (fixed an upstream inconsistency), `warn` (logged only; in warn
    mode, what strict/fix would do), `error` (refused), `none` (checked, nothing to do). `source`: who set `before`;
    `after`: the value set, or that would be set when not `applied`."""

    rule_id: str
    action: Action
    setting: str
    before: Any
    after: Any
    source: str
    reason: str
    evidence: tuple[str, ...] = field(default_factory=tuple)
    applied: bool = False
    stage: str = "init_end"
    level: Level = "info"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["evidence"] = list(self.evidence)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        data = dict(data)
        data["evidence"] = tuple(data.get("evidence", ()))
        data.setdefault("level", level_of(data["action"]))
        return cls(**data)

    @property
    def changes(self) -> bool:
        return self.action in ("default", "override", "repair") or (self.action == "warn" and self.after != self.before)

    def line(self) -> str:
        """The one-line log form: rule id, action, the change, who set the value, the reason's first sentence."""
        verb = "" if self.applied or self.action in ("none", "error") else " (not applied)"
        if self.source == "runtime":  # a check of the running training: what it found is the reason
            return f"[{self.rule_id}] {self.action}{verb}: {first_sentence(self.reason)}"
        if self.action == "none" or self.before == self.after:
            change = f"{self.setting}={self.before!r}"
        else:
            change = f"{self.setting}: {self.before!r} -> {self.after!r}"
        who = "was unset" if self.source == "unset" else f"set by {self.source}"
        return f"[{self.rule_id}] {self.action}{verb}: {change} ({who}). {first_sentence(self.reason)}"


class Decisions(list[Decision]):
    """What `engine.decide` returns: the decisions, in the order they are applied."""

    @property
    def in_force(self) -> tuple[Any, str] | None:
        """The `use_reentrant` they leave in the args and who chose it (`plugin` for a value the plugin writes; in warn
        mode the value found); None when none of them is about it."""
        found = None
        for d in self:
            if d.setting not in ("use_reentrant", "activation_checkpointing_kwargs"):
                continue
            if d.applied:
                found = d.after, ("plugin" if d.action in ("default", "override") else d.source)
            elif d.action in ("none", "warn", "error"):
                found = d.before, d.source
        return found

    def where(self, keep: Callable[[Decision], bool]) -> Decisions:
        return Decisions(d for d in self if keep(d))


def first_sentence(text: str, limit: int = 240) -> str:
    for end in (". ", "; see "):
        cut = text.find(end)
        if cut != -1:
            text = text[: cut + 1]
            break
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_decisions(decisions: list[Decision], output_dir: str | os.PathLike[str] | None) -> str | None:
    """Write `decisions` to `<output_dir>/gc_decisions.json` and return its path; None (nothing written) without an
    existing directory: the Trainer creates it on the process that saves."""
    if not output_dir or not os.path.isdir(output_dir):
        return None
    path = os.path.join(os.fspath(output_dir), DECISIONS_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump([d.to_dict() for d in decisions], fh, indent=2, default=repr)
        fh.write("\n")
    return path
