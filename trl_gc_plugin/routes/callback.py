"""`SafeGCCallback`: decides, fixes and verifies gradient checkpointing for one Trainer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from transformers import TrainerCallback

from .._base import report
from .._base.weak import WeakIdMap
from ..core.decisions import Decision
from ..core.errors import GCConfigError, contained
from ..core.modes import Mode
from ..core.settings import GCSettings
from ..model import probe
from ..model.observe import Call
from ..runtime import hosts, tracker
from ..runtime.run import Run
from . import model_route

_OWNERS: WeakIdMap[SafeGCCallback] = WeakIdMap()  # the callback acting for a Trainer, by its `TrainerState`

F = TypeVar("F", bound=Callable[..., Any])


def _guarded(event: F) -> F:
    """A plugin bug never stops training: the callback stands down for the run; a `GCConfigError` stops it."""

    @functools.wraps(event)
    def wrapper(self: SafeGCCallback, *args: Any, **kwargs: Any) -> Any:
        if self._broken:
            return None
        with contained(event.__name__, functools.partial(self._stand_down, event.__name__)):
            return event(self, *args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]


class SafeGCCallback(TrainerCallback):
    """A [`~transformers.TrainerCallback`] that makes gradient checkpointing safe for the run it is attached to.

    `on_init_end` decides `use_reentrant` with the rule table and writes it into the arguments and the model;
    `on_train_begin` repairs the model and watches the first training forward for the silent failure (reentrant blocks
    with trainable parameters and no input requiring grad); the first optimizer step audits the gradients; each step
    keeps the decision in place (DPO and GRPO re-enable every step). Nothing is stored on what checkpoints save.

    Args:
        mode (`str`, *optional*): `"strict"` (default) fills unset values, repairs upstream inconsistencies and raises
            `GCConfigError` before any update for an explicit choice known to break training; `"fix"` overrides such
            a choice with a loud warning; `"warn"` changes nothing and logs what strict/fix would do. `None`: the mode
            given to `install()`, else `TRL_GC_PLUGIN_MODE`, else strict.
        write_json (`bool`, defaults to `True`): write `<output_dir>/gc_decisions.json` (main process).
        audit (`bool`, *optional*): the first-step gradient audit; defaults to `TRL_GC_PLUGIN_AUDIT`, then on.
        parity_check (`bool`, *optional*): compare gradients with and without checkpointing once, on a synthetic
            16-token sequence (two extra passes, ~9-10% of one step). `None`: on for reentrant runs of causal LMs in
            single-process runs.
        memory_budget (`str` or `int`, *optional*): activation memory per device (`"40GiB"`, bytes, or `"auto"`:
            free CUDA memory less the optimizer state); the plugin then applies the fastest checkpointing plan that
            fits (rule `memory-plan`) and checks it against the first forward. `None`: `install()`'s, else
            `TRL_GC_PLUGIN_BUDGET`, else no plan.

    Example: `SFTTrainer(..., args=SFTConfig(gradient_checkpointing=True, ...), callbacks=[SafeGCCallback()])`
    """

    auto_registered = False
    offloader: str | None = None  # a launcher's activation offloading that replaces checkpointing (Axolotl's)

    def __init__(
        self,
        mode: str | None = None,
        write_json: bool = True,
        audit: bool | None = None,
        parity_check: bool | None = None,
        memory_budget: str | int | None = None,
    ) -> None:
        given = {"mode": mode, "write_json": write_json, "audit": audit, "parity_check": parity_check}
        self.settings = resolved = GCSettings.resolve({**given, "memory_budget": memory_budget})
        self.mode: Mode = resolved.mode
        self.memory_budget = resolved.memory_budget
        self.write_json = resolved.write_json
        self.audit = resolved.audit
        self.parity_check = resolved.parity_check
        self._owner: SafeGCCallback | None = None
        self._active = self._broken = False
        self._reset_run()
        report.setup()

    def __getstate__(self) -> dict[str, Any]:
        """A pickle or copy of the callback (the Trainer's `CallbackHandler` pickles with it) keeps the settings and
        what was decided, and acts for no Trainer: its run carries no hook (`Record.__getstate__`)."""
        return {**self.__dict__, "_active": False}

    def register(self, cfg: Any = None) -> None:
        """Axolotl calls `register` on what its `plugins:` list names: say which line to write."""
        raise GCConfigError(
            "trl_gc_plugin.SafeGCCallback is a Trainer callback, not an Axolotl plugin: write "
            "`plugins: [trl_gc_plugin.integrations.axolotl.SafeGCPlugin]` in the Axolotl config."
        )

    @property
    def decisions(self) -> list[Decision]:
        """The decisions for the last Trainer this callback saw (the acting callback's when this one stood by)."""
        return self._owner.decisions if self._owner is not None else self._run.decisions

    @property
    def observed(self) -> dict[str, Call]:
        first_forward = self._run.first_forward
        return first_forward.observed if first_forward is not None else {}

    @property
    def plan_check(self) -> Any:
        """With a memory budget: the plan's predicted saved bytes against the first training forward's."""
        plan = self._run.memory_plan
        return plan.comparison if plan is not None else None

    def _reset_run(self) -> None:
        self._run = Run(self.settings, offloader=self.offloader)
        self._tracked = False

    @_guarded
    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        owner = self._owner_for(state)
        if owner is not self:
            self._become_passive(owner)
            return
        self._active, self._owner = True, None
        self._reset_run()
        self._run.args = args
        report.follow_trainer(args)
        if self.auto_registered:  # TRL_GC_PLUGIN=1 / install() inside a launcher without its integration
            with contained("the launcher's adaptation"):
                hosts.adopt(args)
        tracker.move_before_reporters(self)  # a callback passed to the Trainer comes after the reporters
        if model is None:
            return
        model_route.claim(model)  # the Trainer route owns this model: the model route stays silent
        record = probe.get_record(args)  # what the patched __post_init__ decided, when it ran
        self._run.decide(args, model, list(record.decisions) if record is not None else [])

    @_guarded
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        """The plugin's summary for the reporters, once, after the first step (`logs` is already in the state)."""
        if self._tracked or not self._active or not isinstance(logs, dict) or state.global_step < 1:
            return
        self._tracked = True
        if not getattr(state, "is_world_process_zero", True):
            return
        text = bool(set(tracker.reporters(args)) & tracker.TEXT_REPORTERS)
        held = self._run.reentrant
        logs.update(tracker.summary(self.decisions, held.value, held.source, self.mode, self.plan_check, text))

    @_guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._active and model is not None:
            facts = self._run.begin(args, model, self._asked(args))
            self._run.arm_first_step(facts, model)

    @_guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._run.step_begin()

    @_guarded
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self._run.before_optimizer_step(model)

    @_guarded
    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._run.step_end(self._asked(args))

    @_guarded
    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._active:
            self._run.finish("the Trainer took no optimizer step")

    @staticmethod
    def _asked(args: Any) -> bool:
        return bool(getattr(args, probe.flag_field(args), False))

    def _stand_down(self, event: str, exc: Exception) -> None:
        self._broken, self._active = True, False
        self._run.fail(exc, event)

    def _owner_for(self, state: Any) -> SafeGCCallback:
        """The callback that acts for this Trainer: an explicitly passed one before the one `install()` registered."""
        owner = _OWNERS.get(state)
        if owner is None:
            peers = _explicit_callbacks_of_this_trainer() if self.auto_registered else []
            owner = next((p for p in peers if p is not self), self)
            _OWNERS.set(state, owner)
        return owner

    def _become_passive(self, owner: SafeGCCallback) -> None:
        self._active, self._owner = False, owner
        if owner.mode != self.mode:
            report.note(
                f"SafeGCCallback is registered twice for this Trainer: the one passed to the Trainer acts "
                f"(mode={owner.mode}); the one from install()/TRL_GC_PLUGIN (mode={self.mode}) stands by.",
                "warning",
            )


def _explicit_callbacks_of_this_trainer() -> list[SafeGCCallback]:
    """The `SafeGCCallback`s passed explicitly to the Trainer whose `CallbackHandler` is calling now."""
    callbacks = getattr(tracker.calling_handler(), "callbacks", None)
    return [c for c in callbacks or () if isinstance(c, SafeGCCallback) and not c.auto_registered]


class AutoSafeGCCallback(SafeGCCallback):
    """The class `install()` and `TRL_GC_PLUGIN=1` put in `transformers.trainer.DEFAULT_CALLBACKS`."""

    auto_registered = True
