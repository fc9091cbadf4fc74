"""The plugin's decisions and figures in the run's tracker (W&B, TensorBoard, MLflow, ... whatever `report_to` says).

transformers' reporters are `TrainerCallback`s that write what `Trainer.log` hands to `on_log`. The plugin adds its
summary to the first `logs` dict after the first training step, on the main process: the `use_reentrant` that runs
and who chose it, counts of refusals / overrides / repairs / warnings, and with a memory budget the plan's predicted
and measured activation bytes of the first forward. `Trainer.log` appends a copy of `logs` to
`state.log_history` *before* calling `on_log`, so nothing of the plugin reaches `trainer_state.json` or any checkpoint.

A reporter only sees what the callbacks before it added. transformers orders the callbacks as `DEFAULT_CALLBACKS`
(where `install()` / `TRL_GC_PLUGIN=1` put the plugin), then the reporters of `report_to`, then the callbacks passed
to the Trainer. So a `SafeGCCallback` passed by the user would come after the reporters: at `on_init_end` it moves
itself to just before the first reporter in the Trainer's `CallbackHandler` (found on the call stack: the handler is
the caller of every event), and nothing else in the order changes. Where the handler cannot be found, the figures
still go into `logs` (the console's log line shows them) and the reporters before the callback miss them; the
decision file `gc_decisions.json` has everything either way.

Strings go only to the reporters known to take them (`TensorBoard` writes them as text, W&B and trackio as they are);
MLflow and the others get the numbers only (MLflow warns for every string).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

PREFIX = "trl_gc/"
TEXT_REPORTERS = frozenset({"tensorboard", "wandb", "trackio"})
"""`report_to` names whose callbacks log a string value as it is."""


def reporters(args: Any) -> list[str]:
    """The normalized `report_to` of the arguments (`"all"` / `None` as transformers resolves them, best effort)."""
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
    out[PREFIX + "refusals"] = actions.count("error")
    out[PREFIX + "overrides"] = actions.count("override")
    out[PREFIX + "repairs"] = actions.count("repair")
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
    """The Trainer's `CallbackHandler` whose event the caller of this function's caller is handling (a read-only look
    at the call stack, `depth` frames up); None when there is none."""
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


def move_before_reporters(callback: Any) -> bool:
    """Put `callback` just before the first reporter of the Trainer's `CallbackHandler` on the call stack (the caller
    of the event being handled). True when it moved; False when it already ran before them or no handler was found."""
    handler = calling_handler()
    if handler is None:
        return False
    callbacks = handler.callbacks
    if not any(c is callback for c in callbacks):
        return False
    mine = next(i for i, c in enumerate(callbacks) if c is callback)
    first = next((i for i, c in enumerate(callbacks) if _is_reporter(c)), None)
    if first is None or first > mine:
        return False
    callbacks.insert(first, callbacks.pop(mine))
    return True
