"""The check at every step end: the arguments and the model still hold the decision (TRL's DPO and GRPO re-enable
checkpointing every step), and the input embeddings carry one input-require-grad hook, not a pile. A few attribute
reads per step."""

from __future__ import annotations

from typing import Any

from ..core.policy import action_for
from ..core.rules import get_rule
from .session import Session, runtime_decision


def check(session: Session) -> None:
    """Repair (or, in warn mode and when the plugin stands back, report) what drifted since the last step."""
    watch = session.watch
    if watch is None:
        return
    drifted = watch.drift() + (session.guard.drifted() if session.guard is not None else [])
    if drifted:
        _repair(session, drifted)
    if watch.embeddings is not None and watch.input_hooks() > 1:
        _dedupe_hooks(session)


def _repair(session: Session, drifted: list[tuple[str, Any]]) -> None:
    assert session.watch is not None
    rule, value = get_rule("checkpointing-drift"), session.watch.value
    report_only = action_for(session.mode, "repair", stands_back=session.stands_back()) == "warn"
    verdicts = []
    for setting, found in drifted:
        if session.count(f"drift:{setting}") > 1:
            continue
        if setting in ("layer_pattern", "checkpoint_function") and session.guard is not None:
            expected: Any = session.guard.pattern if setting == "layer_pattern" else "as enabled at train begin"
            reason = f"{setting} drifted to {found!r} mid-training; restored to {expected!r}."
        else:
            expected, reason = value, f"{setting} drifted to {found!r} mid-training; decided {value!r}."
        action = "warn" if report_only else "repair"
        verdicts.append(runtime_decision(rule, action, found, expected, reason, setting=setting))
    if not report_only:
        session.switch(value)
        if session.guard is not None:
            session.guard.reapply()
    session.record(verdicts)


def _dedupe_hooks(session: Session) -> None:
    watch = session.watch
    assert watch is not None
    rule = get_rule("input-hook-pileup")
    before = watch.input_hooks()
    action = action_for(session.mode, "repair")
    if action == "repair":
        watch.dedupe_input_hooks()
    if session.count("hooks") == 1:
        reason = f"{before} input-require-grad hooks on the input embeddings; kept one."
        session.record([runtime_decision(rule, action, before, watch.input_hooks(), reason, level="info")])
