"""A run's record (decisions, its hooks, `model.write.UseReentrant` holding the `use_reentrant` in force): how a
finding is recorded, refused or repaired, and how the run leaves. `run.Run` adds the stages; the runtime checks take
a `Record`."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from .._base import report
from ..core.decisions import Action, Decision, Level, write_decisions
from ..core.errors import GCConfigError, raise_for_errors
from ..core.rules import RULES, Rule
from ..core.settings import GCSettings
from ..model.enable_guard import EnableGuard
from ..model.hooks import Hooks
from ..model.verify import Watch
from ..model.write import CacheSwitch, UseReentrant

STAND_BACK = frozenset(r.id for r in RULES if r.stand_back)


def runtime_decision(
    rule: Rule,
    action: Action,
    before: Any,
    after: Any,
    reason: str,
    setting: str | None = None,
    level: Level | None = None,
) -> Decision:
    return rule.decision(action, before, after, "runtime", reason, "train", setting, level)


def names_of(found: list[str], limit: int = 6) -> str:
    return ", ".join(found[:limit]) + (" ..." if len(found) > limit else "")


def _no_model() -> Any:
    return None


class _Strong:
    """A model that cannot be weakly referred to, held as `weakref.ref` would give it."""

    __slots__ = ("model",)

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self) -> Any:
        return self.model


class Record:
    """What the plugin knows and did about one run, on any route."""

    def __init__(self, settings: GCSettings, main_process: bool | None = None, write_json: bool = True) -> None:
        self.settings = settings
        self.mode = settings.mode
        self.main_process = main_process  # given where the arguments must not be asked (`__post_init__`)
        self.write_json = write_json and settings.write_json
        self.args: Any = None
        self._model: Callable[[], Any] = _no_model
        self.decisions: list[Decision] = []
        self.reentrant = UseReentrant()  # the `use_reentrant` in force and who chose it: its one holder
        self.json_path: str | None = None
        self.reported: dict[str, int] = {}
        self.hooks = Hooks()
        self.watch: Watch | None = None
        self.guard: EnableGuard | None = None
        self.cache: CacheSwitch | None = None
        self.stopped = False

    # What lives only as long as the run does (the model, its hooks and checks): a pickle or a copy of the record
    # (the Trainer's callbacks are pickled with its `CallbackHandler`) carries what was decided, and no hook: hooks
    # are registered by identity in `model.hooks`' tables, so a copy of one would belong to no registry.
    LIVE: tuple[str, ...] = ("args", "_model", "hooks", "watch", "guard", "cache")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self.LIVE:
            state[name] = None
        state["stopped"] = True  # a copy drives nothing: a new run starts from a new record
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._model = _no_model
        self.hooks = Hooks()

    @property
    def model(self) -> Any:
        return self._model()

    @model.setter
    def model(self, model: Any) -> None:
        try:
            self._model = weakref.ref(model) if model is not None else _no_model
        except TypeError:  # not weakly referable
            self._model = _Strong(model)

    def stands_back(self) -> bool:
        """Another library or the model's own code owns checkpointing: the plugin decides nothing, only reports."""
        return any(d.rule_id in STAND_BACK for d in self.decisions)

    def explicit(self) -> tuple[bool, str]:
        """Whether the running `use_reentrant=True` is the user's own choice (or of unknown origin); its source."""
        return self.reentrant.explicit(), self.reentrant.source

    def count(self, key: str) -> int:
        self.reported[key] = self.reported.get(key, 0) + 1
        return self.reported[key]

    def is_main(self) -> bool:
        return self.main_process if self.main_process is not None else report.is_main_process(self.args)

    def record(self, new: list[Decision]) -> None:
        if new:
            self.decisions.extend(new)
            self.publish(new)

    def conclude(self, new: list[Decision], mode: str | None = None) -> None:
        """Record a check's findings and refuse for its `error` ones (in `mode`, the run's by default)."""
        self.record(new)
        self.refuse(new, mode, recorded=True)

    def refuse(self, decisions: list[Decision], mode: str | None = None, recorded: bool = False) -> None:
        """Raise `GCConfigError` for the `error` decisions (not in warn mode), after removing the run's hooks."""
        mode = mode or self.mode
        if mode == "warn" or not any(d.action == "error" for d in decisions):
            return
        if not recorded:
            self.publish(decisions)
        try:
            raise_for_errors(decisions, mode)
        except GCConfigError:
            self.stop()
            raise

    def publish(self, new: list[Decision]) -> None:
        """Log the new decisions and rewrite `gc_decisions.json` when checkpointing is involved."""
        main = self.is_main()
        report.log_decisions(new, main)
        if not (main and self.write_json and any(d.rule_id != "checkpointing-off" for d in self.decisions)):
            return
        output_dir = getattr(self.args, "output_dir", None)
        self.json_path = write_decisions(self.decisions, output_dir) or self.json_path
        if self.json_path is None and output_dir and output_dir == self.settings.output_dir:
            where = self.settings.origin("output_dir")
            report.note(
                f"gc_decisions.json not written: {where} names {str(output_dir)!r}, which is not an existing directory "
                "(the plugin creates none); the decisions are in the log.",
                "warning",
            )

    def switch(self, value: bool) -> None:
        """A check's decision at runtime (first forward, first step, drift): the arguments and the live model."""
        self.reentrant.switch(self.args, self.model, value)
        if self.watch is not None:
            self.watch.args_value = value

    def ensure_guard(self, layer_kwargs: Any, keep: bool = True) -> EnableGuard:
        """The enable guard, installed once: reports each re-enable to `reenabled`; `keep`: keeps what was enabled."""
        if self.guard is None:
            self.guard = EnableGuard(self.model, layer_kwargs, keep, after=self.reenabled)
            self.guard.install(self.hooks)
        self.guard.keep = self.guard.keep or keep
        return self.guard

    def reenabled(self) -> None:
        """The model's checkpointing was enabled again (`Run` checks drift)."""

    def stop(self, keep_repairs: bool = False) -> None:
        """Remove every trace of the run (its hooks, its repairs unless `keep_repairs`, the `use_cache` switch)."""
        self.stopped = True
        self.hooks.remove(keep_repairs=keep_repairs)
        self.guard = None
        if self.cache is not None:
            self.cache.restore()
            self.cache = None
        self.watch = None


class Check:
    """A first-step check whose hooks (`_handles`) go at `remove` (idempotent)."""

    def __init__(self, run: Record) -> None:
        self.run = run
        self._handles: list[Any] = []

    def remove(self) -> None:
        for handle in self._handles:
            self.run.hooks.discard(handle)
        self._handles = []
