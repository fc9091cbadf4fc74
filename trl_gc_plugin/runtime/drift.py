"""At every step end and re-enable (TRL's DPO and GRPO re-enable every step): the arguments and the model still hold
the decision, and the input embeddings carry one input-require-grad hook, not a pile."""

from __future__ import annotations

from typing import Any

from ..core.policy import action_for
from ..core.rules import get_rule
from ..model.verify import Watch
from .record import Record, runtime_decision


def check(run: Record, cause: str = "mid-training") -> None:
    """Repair (or, in warn mode and when the plugin stands back, report) what drifted since the last look."""
    watch = run.watch
    if watch is None:
        return
    keeps = run.guard is not None and run.guard.keep  # a guard that keeps nothing only reports re-enables
    drifted = watch.drift(run.reentrant.value) + (run.guard.drifted() if keeps else [])
    if drifted:
        _repair(run, watch, drifted, cause)
    if watch.embeddings is not None and watch.input_hooks() > 1:
        _dedupe_hooks(run, watch)


def _repair(run: Record, watch: Watch, drifted: list[tuple[str, Any]], cause: str) -> None:
    rule = get_rule("checkpointing-drift")
    value = run.reentrant.value if isinstance(run.reentrant.value, bool) else watch.baseline
    action = action_for(run.mode, "repair", stands_back=run.stands_back())
    verdicts = []
    for setting, found in drifted:
        if run.count(f"drift:{setting}") > 1:
            continue
        if setting in ("layer_pattern", "checkpoint_function") and run.guard is not None:
            expected: Any = run.guard.layout.pattern if setting == "layer_pattern" else "as enabled at train begin"
            reason = f"{setting} drifted to {found!r} {cause}; restored to {expected!r}."
        else:
            expected, reason = value, f"{setting} drifted to {found!r} {cause}; decided {value!r}."
        verdicts.append(runtime_decision(rule, action, found, expected, reason, setting=setting))
    if action != "warn" and isinstance(value, bool):
        run.switch(value)
        if run.guard is not None and run.guard.keep:
            run.guard.reapply()
    run.record(verdicts)


def _dedupe_hooks(run: Record, watch: Watch) -> None:
    rule = get_rule("input-hook-pileup")
    before = watch.input_hooks()
    action = action_for(run.mode, "repair")
    if action == "repair":
        watch.dedupe_input_hooks()
    if run.count("hooks") == 1:
        reason = f"{before} input-require-grad hooks on the input embeddings; kept one."
        run.record([runtime_decision(rule, action, before, watch.input_hooks(), reason, level="info")])
