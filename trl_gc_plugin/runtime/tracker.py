"""The plugin's summary in the run's tracker (`report_to`): added to the first `logs` after the first step, which
`Trainer.log` has already copied into the state (nothing reaches `trainer_state.json`). A reporter sees only what the
callbacks before it added, so the plugin moves itself before the first one; strings go only to those that take them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

PREFIX = "trl_gc/"
TEXT_REPORTERS = frozenset({"tensorboard", "wandb", "trackio"})  # `report_to` names that log a string as it is


def reporters(args: Any) -> list[str]:
    """The normalized `report_to` of the arguments (`"all"` as transformers resolves it, best effort)."""
    value = getattr(args, "report_to", None)
    if value is None or value == "none":
        return []
    names = [value] if isinstance(value, str) else list(value)
    if names == ["all"]:
        try:
            from transformers.integrations import get_available_reporting_integrations

            names = list(get_available_reporting_integrations())
        except Exception:
            return []
    return [str(n) for n in names if n != "none"]


def summary(
    decisions: Sequence[Any],
    use_reentrant: Any,
    source: str,
    mode: str,
    plan_check: Any = None,
    text: bool = True,
) -> dict[str, Any]:
    """The values the plugin adds to the run's logs (keys under `trl_gc/`); empty when it decided nothing."""
    if not decisions or all(getattr(d, "rule_id", "") == "checkpointing-off" for d in decisions):
        return {}
    out: dict[str, Any] = {}
    if isinstance(use_reentrant, bool):
        out[PREFIX + "use_reentrant"] = int(use_reentrant)
    actions = [getattr(d, "action", "") for d in decisions]
    for key, action in (("refusals", "error"), ("overrides", "override"), ("repairs", "repair")):
        out[PREFIX + key] = actions.count(action)
    out[PREFIX + "warnings"] = sum(1 for d in decisions if getattr(d, "level", "") == "warning")
    if plan_check is not None:
        out[PREFIX + "plan_predicted_bytes"] = int(plan_check.predicted)
        out[PREFIX + "plan_measured_bytes"] = int(plan_check.measured)
    if text:
        out[PREFIX + "use_reentrant_source"] = source
        out[PREFIX + "mode"] = mode
        flagged = sorted({d.rule_id for d in decisions if getattr(d, "level", "") in ("warning", "error")})
        if flagged:
            out[PREFIX + "flagged_rules"] = ", ".join(flagged)
    return out


def _is_reporter(callback: Any) -> bool:
    module = getattr(type(callback), "__module__", "") or ""
    return module.startswith("transformers.integrations")


def calling_handler(depth: int = 12) -> Any:
    """The Trainer's `CallbackHandler` handling an event up the caller's call stack (read only), else None."""
    try:
        from transformers.trainer_callback import CallbackHandler

        frame = sys._getframe(2)
        for _ in range(depth):
            if frame is None or isinstance(frame.f_locals.get("self"), CallbackHandler):
                break
            frame = frame.f_back
        return None if frame is None else frame.f_locals.get("self")
    except Exception:  # never let the look fail the run
        return None


def move_before_reporters(callback: Any) -> None:
    """Put `callback` just before the first reporter of the calling `CallbackHandler` (if it comes after one)."""
    handler = calling_handler()
    callbacks = handler.callbacks if handler is not None else []
    mine = next((i for i, c in enumerate(callbacks) if c is callback), None)
    first = next((i for i, c in enumerate(callbacks) if _is_reporter(c)), None)
    if mine is not None and first is not None and first < mine:
        callbacks.insert(first, callbacks.pop(mine))
