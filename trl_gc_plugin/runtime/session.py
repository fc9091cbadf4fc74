"""`Session`: one Trainer run as the plugin sees it, the one holder of its decisions and of the `use_reentrant` in force.

The callback opens a session at `on_init_end`; the runtime checks (`first_forward.py`, `first_step.py`, `drift.py`,
`runtime_plan.py`) record through it, refuse through it and switch `use_reentrant` through it, and `stop()` removes
every trace of the run from the model (hooks, the enable guard, the `use_cache` switch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from .._base import report
from ..core.decisions import Action, Decision, Level, write_decisions
from ..core.engine import final_use_reentrant
from ..core.errors import GCConfigError, raise_for_errors
from ..core.modes import Mode
from ..core.rules import RULES, Rule
from ..model import ckpt, probe
from ..model.enable_guard import EnableGuard
from ..model.verify import Watch
from ..model.write import CacheSwitch, apply, remove_input_hook, set_args_kwarg

STAND_BACK = frozenset(r.id for r in RULES if r.stand_back)
"""Rules that hand checkpointing to another library or the model's own code: the plugin then decides nothing."""


class Check(Protocol):
    """A runtime check: installed at train begin (hooks on the model or off it), removed when its step is over or the
    run is refused."""

    def remove(self) -> None: ...


def runtime_decision(
    rule: Rule,
    action: Action,
    before: Any,
    after: Any,
    reason: str,
    setting: str | None = None,
    level: Level | None = None,
) -> Decision:
    """A decision taken while the run trains (source `runtime`, stage `train`)."""
    return rule.decision(action, before, after, "runtime", reason, "train", setting, level)


class Session:
    """One run: its arguments and model, the mode, every decision taken for it and the `use_reentrant` in force.

    Args:
        mode (`Mode`): strict, fix or warn.
        write_json (`bool`): rewrite `<output_dir>/gc_decisions.json` with every new decision (main process).
        main_process (`bool`, *optional*): whether this is the main process, when the arguments must not be asked
            (in `__post_init__`, before the distributed state is set up); else read from the arguments.
    """

    def __init__(self, mode: Mode, write_json: bool = True, main_process: bool | None = None) -> None:
        self.mode = mode
        self.write_json = write_json
        self.main_process = main_process
        self.args: Any = None
        self.model: Any = None
        self.decisions: list[Decision] = []
        self.final: tuple[Any, str] = (None, "unset")
        """The `use_reentrant` in force and who set it (`user`, `plugin`, a launcher, `unset`)."""
        self.json_path: str | None = None
        self.reported: dict[str, int] = {}
        self.watch: Watch | None = None
        self.guard: EnableGuard | None = None
        self.cache: CacheSwitch | None = None
        self.checks: list[Check] = []
        self.undo: list[Callable[[], Any]] = []
        """What puts back a repair made on the model (an input hook), run by `stop()` unless the repairs stay."""
        self.stopped = False
        """`stop()` ran: the run was refused or is over."""

    # --- what the run is ---------------------------------------------------------------------------------------

    def stands_back(self) -> bool:
        """Another library or the model's own code owns checkpointing (a `stand_back` rule applied): the plugin
        decides nothing and only reports what its checks see."""
        return any(d.rule_id in STAND_BACK for d in self.decisions)

    def explicit(self) -> tuple[bool, str]:
        """Whether the running `use_reentrant=True` is the user's own choice (or of unknown origin), and its source."""
        value, source = self.final
        return value is True and source in ("user", "unknown"), source

    def count(self, key: str) -> int:
        """How many times `key` has been seen this run, this time included (a finding is said once)."""
        self.reported[key] = self.reported.get(key, 0) + 1
        return self.reported[key]

    def set_final(self, value: Any, source: str) -> None:
        self.final = (value, source)
        probe.remember(self.args, value, source)

    # --- recording and refusing --------------------------------------------------------------------------------

    def take(self, decisions: list[Decision], model: Any) -> None:
        """A stage's decisions (`engine.decide`): record them, refuse (before anything changes), apply them to the
        arguments and the model, follow the `use_reentrant` they leave in force, and publish them."""
        self.decisions.extend(decisions)
        self.refuse(decisions)
        for d in apply(decisions, self.args, model):
            if d.setting == "inputs_require_grad" and model is not None:
                self.undo.append(functools.partial(remove_input_hook, model))
        self.set_final(*final_use_reentrant(decisions, *self.final))
        self.publish(decisions)

    def record(self, new: list[Decision]) -> None:
        if not new:
            return
        self.decisions.extend(new)
        self.publish(new)

    def publish(self, new: list[Decision]) -> None:
        """Log the new decisions (main process) and rewrite `gc_decisions.json` when checkpointing is involved."""
        main = self.main_process if self.main_process is not None else report.is_main_process(self.args)
        report.log_decisions(new, main)
        worth_a_file = any(d.rule_id != "checkpointing-off" for d in self.decisions)
        if main and self.write_json and worth_a_file:
            self.json_path = write_decisions(self.decisions, getattr(self.args, "output_dir", None)) or self.json_path

    def refuse(self, decisions: list[Decision]) -> None:
        """Before anything is applied: in strict/fix mode, log and raise for `error` decisions."""
        if self.mode != "warn" and any(d.action == "error" for d in decisions):
            self.publish(decisions)
            self.raise_for_errors(decisions, self.mode)

    def raise_for_errors(self, decisions: list[Decision], mode: str) -> None:
        """Raise `GCConfigError` for the `error` decisions, after removing every trace of the run from the model: a
        refused run never reaches `on_train_end`, and a hook left waiting would keep the model alive in the
        process-wide hook table."""
        try:
            raise_for_errors(decisions, mode)
        except GCConfigError:
            self.stop()
            raise

    # --- acting on the model -----------------------------------------------------------------------------------

    def switch(self, value: bool) -> None:
        """Run `use_reentrant=value` from now on: the arguments, the model, the drift watch and the record."""
        set_args_kwarg(self.args, "use_reentrant", value)
        if self.model is not None:
            ckpt.set_keyword(self.model, "use_reentrant", value)
        if self.watch is not None:
            self.watch.value = self.watch.args_value = value
        self.set_final(value, "plugin")

    def ensure_guard(self, layer_kwargs: Any) -> EnableGuard:
        """The enable guard that keeps what the plugin enabled across re-enables, installed once."""
        if self.guard is None:
            self.guard = EnableGuard(self.model, layer_kwargs)
            self.guard.install()
        return self.guard

    def stop(self, keep_repairs: bool = False) -> None:
        """Remove every trace of the run from the model (checks' hooks, the enable guard, the repairs made on it
        unless `keep_repairs`: a loop's later steps need them) and its config (use_cache)."""
        self.stopped = True
        undo, self.undo = ([] if keep_repairs else self.undo), []
        for action in reversed(undo):
            try:
                action()
            except Exception as exc:  # a plugin bug never crashes training: say it and go on
                report.note(f"could not undo a repair on the model ({type(exc).__name__}: {exc})", "warning")
        if self.guard is not None:
            self.guard.remove()
            self.guard = None
        checks, self.checks = self.checks, []
        for check in checks:
            check.remove()
        if self.cache is not None:
            self.cache.restore()
            self.cache = None
        self.watch = None
