"""The `Decision` record, and how decisions are logged and written.

A decision is the one structured thing the plugin produces: the engine returns them, `apply.py` carries them out,
the logger prints them, `gc_decisions.json` stores them and the tests assert on them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .rules import Rule

logger = logging.getLogger("trl_gc_plugin")

Action = Literal["default", "override", "repair", "warn", "error", "none"]

DECISIONS_FILE = "gc_decisions.json"

_LEVELS: dict[str, int] = {
    "none": logging.INFO,
    "default": logging.INFO,
    "repair": logging.WARNING,
    "warn": logging.WARNING,
    "override": logging.WARNING,
    "error": logging.ERROR,
}


@dataclass(frozen=True)
class Decision:
    """One decision of the plugin about one setting.

    Args:
        rule_id: the rule that produced it (see `trl_gc_plugin.RULES`).
        action: `default` (filled a value nobody set), `override` (replaced an explicit value, fix mode),
            `repair` (fixed an upstream inconsistency), `warn` (logged only; in warn mode, what strict/fix would
            do), `error` (strict mode refuses the setup), `none` (checked, nothing to do).
        setting: what it is about, e.g. `gradient_checkpointing_kwargs.use_reentrant`, `model.config.use_cache`.
        before: the value found.
        after: the value set (or that would be set, when `applied` is False).
        source: who set `before`: `user`, `trainer`, `plugin`, `unset` or `unknown`.
        reason: one line saying why.
        evidence: links to the issues, PRs and code behind the rule.
        applied: whether `after` was written.
        stage: `post_init`, `init_end` or `train`.
    """

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

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["evidence"] = list(self.evidence)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=repr)

    @classmethod
    def from_rule(
        cls,
        rule: Rule,
        action: Action,
        before: Any,
        after: Any,
        source: str,
        reason: str,
        stage: str,
        setting: str | None = None,
    ) -> Decision:
        """A decision of `rule` (its id, setting and evidence); applied when the action changes something."""
        return cls(
            rule_id=rule.id,
            action=action,
            setting=setting or rule.setting,
            before=before,
            after=after,
            source=source,
            reason=reason,
            evidence=rule.evidence,
            applied=action in ("default", "override", "repair"),
            stage=stage,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        data = dict(data)
        data["evidence"] = tuple(data.get("evidence", ()))
        return cls(**data)

    @property
    def changes(self) -> bool:
        """Whether this decision writes (or would write) a new value."""
        return self.action in ("default", "override", "repair") or (self.action == "warn" and self.after != self.before)

    def line(self) -> str:
        """The one-line log form."""
        verb = "" if self.applied or self.action in ("none", "error") else " (not applied)"
        if self.action == "none" or self.before == self.after:
            change = f"{self.setting}={self.before!r}"
        else:
            change = f"{self.setting}: {self.before!r} -> {self.after!r}"
        return f"[{self.rule_id}] {self.action}{verb}: {change} (set by {self.source}). {self.reason}"


def is_main_process(args: Any = None) -> bool:
    """True on the main process: rank 0 of `args`' distributed state when given, else of the launcher's env vars."""
    if args is not None:
        try:
            return int(args.process_index) == 0
        except Exception:  # args not fully built, or no distributed state yet
            pass
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var)
        if value not in (None, ""):
            try:
                return int(value) == 0
            except ValueError:
                return True
    return True


def log_decisions(decisions: list[Decision], main_process: bool = True) -> None:
    """Log each decision on the `trl_gc_plugin` logger, at a level that matches its action (main process only)."""
    if not main_process:
        return
    for decision in decisions:
        logger.log(_LEVELS.get(decision.action, logging.INFO), decision.line())


def write_decisions(decisions: list[Decision], output_dir: str | os.PathLike[str] | None) -> str | None:
    """Write `decisions` to `<output_dir>/gc_decisions.json`; returns the path, or None without an output dir."""
    if not output_dir:
        return None
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(os.fspath(output_dir), DECISIONS_FILE)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump([d.to_dict() for d in decisions], fh, indent=2, default=repr)
        fh.write("\n")
    return path


def read_decisions(path: str | os.PathLike[str]) -> list[Decision]:
    """Read a `gc_decisions.json` back into `Decision` records."""
    with open(path, encoding="utf-8") as fh:
        return [Decision.from_dict(item) for item in json.load(fh)]
