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
from ..runtime.run import Run
from . import hosts, model_route, tracker

_OWNERS: WeakIdMap[SafeGCCallback] = WeakIdMap()
"""Which callback acts for a Trainer, keyed by the Trainer's `TrainerState` (kept off the state object itself)."""

F = TypeVar("F", bound=Callable[..., Any])


def _guarded(event: F) -> F:
    """A plugin bug never stops training (`errors.contained`): the callback stands down for the rest of the run and
    every hook of the run goes; a deliberate `GCConfigError` stops the run."""

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

    At `on_init_end` it reads the arguments and the model, decides `use_reentrant` with the rule table
    (`trl_gc_plugin.RULES`), validates the combination, writes the decision into the arguments (both the
    `activation_checkpointing*` and the deprecated `gradient_checkpointing*` names, as one object) and into a
    model that already checkpoints, and logs a one-line summary. Then it verifies the running training:

    - `on_train_begin` (checkpointing is live): the model runs what was decided, else it is repaired; one-shot hooks
      watch the first training forward of every checkpointing stack (`observe.py`): a block that runs reentrant with
      trainable parameters and inputs that do not require grad is the silent failure, refused (a value you set,
      strict mode), repaired, or reported before the backward.
    - `on_pre_optimizer_step`, first step only (`audit=True`): every checkpointed block with trainable parameters
      received a gradient; a block without one is blamed on checkpointing only with that evidence, otherwise reported
      as unused by the loss.
    - `on_step_begin` / `on_step_end`: `use_cache` off for the step and back for saves; the arguments and the model
      still hold the decision (DPO and GRPO re-enable checkpointing every step), and the embeddings carry one
      input-require-grad hook, not a pile. A few attribute reads.
    - `on_train_end`: puts back what it changed on the model config.

    Nothing is stored on the arguments, the trainer state or the model config: checkpoints written under the plugin
    load where it is not installed.

    Args:
        mode (`str`, *optional*):
            `"strict"` (default): fill unset values, repair upstream inconsistencies, raise `GCConfigError` before any
            parameter update for an explicit choice known to break training. `"fix"`: as strict, but override such a
            choice with a loud warning. `"warn"`: change nothing, log what strict/fix would do. Any case. `None`: the
            mode given to `install()`, else `TRL_GC_PLUGIN_MODE`, else strict.
        write_json (`bool`, *optional*, defaults to `True`):
            Write the decisions to `<output_dir>/gc_decisions.json` (main process, checkpointing on).
        audit (`bool`, *optional*):
            The first-step gradient audit; defaults to `TRL_GC_PLUGIN_AUDIT`, then on.
        parity_check (`bool`, *optional*):
            Compare gradients with and without checkpointing once, at the first optimizer step (before any update),
            on a synthetic 16-token sequence: two extra forward/backward passes (0.5-0.84 s, 9-10% of one step on the modes
            benchmark's model). `None` (default): on when the run is reentrant, the less verified path, for causal
            language models in single-process runs; `True`/`False`: always / never.

        memory_budget (`str` or `int`, *optional*):
            Activation memory per device (`"40GiB"`, `"512MiB"`, bytes, or `"auto"`: the free CUDA memory at train
            begin less the optimizer state). With a budget, the plugin plans how much to checkpoint: the fastest
            candidate (no checkpointing, every n-th block, every block, selective per-op saving, offloading) whose
            predicted peak fits, applied to the live model (rule `memory-plan`), planned at the first training
            forward for the rows it runs and the longest sequence the arguments allow, and checked against what that
            forward saved (off by more than 15%: a warning; fix mode re-plans). `None`: the budget given to
            `install()`, else `TRL_GC_PLUGIN_BUDGET`, else no plan (checkpointing as asked).

    Environment:
        TRL_GC_PLUGIN_MODE: the mode when `mode` is None and `install()` gave none.
        TRL_GC_PLUGIN_AUDIT: `0` switches the gradient audit off when `audit` is None.
        TRL_GC_PLUGIN_BUDGET: the memory budget when `memory_budget` is None and `install()` gave none.

    Attributes:
        decisions (`list[Decision]`): the decisions for the last Trainer this callback saw, the ones taken when
            its arguments were built (with `install()`) first.
        plan_check (`plan_check.Comparison`, *optional*): with a memory budget, the plan's predicted saved bytes
            against those the first training forward saved (None until then, or when not compared).

    Example:
        ```python
        from trl import SFTConfig, SFTTrainer
        from trl_gc_plugin import SafeGCCallback

        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(output_dir="out", gradient_checkpointing=True),
            train_dataset=dataset,
            callbacks=[SafeGCCallback()],
        )
        ```
    """

    auto_registered = False
    offloader: str | None = None
    """A launcher's activation offloading that replaces the Trainer's checkpointing (Axolotl's): said at train begin
    instead of the `checkpointing-unasked` finding."""

    def __init__(
        self,
        mode: str | None = None,
        write_json: bool = True,
        audit: bool | None = None,
        parity_check: bool | None = None,
        memory_budget: str | int | None = None,
    ) -> None:
        given = {"mode": mode, "write_json": write_json, "audit": audit, "parity_check": parity_check}
        resolved = GCSettings.resolve({**given, "memory_budget": memory_budget})
        self.settings = resolved
        self.mode: Mode = resolved.mode
        self.memory_budget = resolved.memory_budget
        self.write_json = resolved.write_json
        self.audit = resolved.audit
        self.parity_check = resolved.parity_check
        self._owner: SafeGCCallback | None = None
        self._active = False
        self._broken = False
        self._reset_run()
        report.setup()

    def register(self, cfg: Any = None) -> None:
        """Axolotl calls `register` on what its `plugins:` list names; this class is a Trainer callback, not an
        Axolotl plugin: say which line to write instead of Axolotl's bare `AttributeError`."""
        raise GCConfigError(
            "trl_gc_plugin.SafeGCCallback is a Trainer callback, not an Axolotl plugin: write "
            "`plugins: [trl_gc_plugin.integrations.axolotl.SafeGCPlugin]` in the Axolotl config."
        )

    @property
    def decisions(self) -> list[Decision]:
        """The decisions for the last Trainer this callback saw (those of the acting callback when this one stood
        by)."""
        return self._owner.decisions if self._owner is not None else self._run.decisions

    @property
    def observed(self) -> dict[str, Call]:
        """What the first training forward passed to each checkpointed block (`observe.Call` by block name)."""
        first_forward = self._run.first_forward
        return first_forward.observed if first_forward is not None else {}

    @property
    def plan_check(self) -> Any:
        """With a memory budget: the plan's predicted saved bytes against those the first training forward saved."""
        plan = self._run.memory_plan
        return plan.comparison if plan is not None else None

    def _reset_run(self) -> None:
        self._run = Run(self.settings, offloader=self.offloader)
        self._tracked = False

    # --- events ------------------------------------------------------------------------------------------------

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
        """Once, in the first log after the first training step, on the main process: the plugin's summary for the
        run's reporters (`tracker.py`); `Trainer.log` has already copied `logs` into the trainer state by then."""
        if self._tracked or not self._active or not isinstance(logs, dict) or state.global_step < 1:
            return
        self._tracked = True
        if not getattr(state, "is_world_process_zero", True):
            return
        text = bool(set(tracker.reporters(args)) & tracker.TEXT_REPORTERS)
        run = self._run
        logs.update(tracker.summary(self.decisions, run.use_reentrant, run.source, self.mode, self.plan_check, text))

    @_guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Checkpointing is live now: check the model runs what was decided; repair it when it does not. Then install
        the first step's checks."""
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
        if not self._active:
            return
        self._run.finish("the Trainer took no optimizer step")

    @staticmethod
    def _asked(args: Any) -> bool:
        return bool(getattr(args, probe.flag_field(args), False))

    def _stand_down(self, event: str, exc: Exception) -> None:
        """After a plugin bug: said once, every hook of the run goes, the callback does nothing more for this run."""
        self._broken, self._active = True, False
        self._run.fail(exc, event)

    # --- two callbacks for one Trainer ---------------------------------------------------------------------------

    def _owner_for(self, state: Any) -> SafeGCCallback:
        """The callback that acts for this Trainer: an explicitly passed `SafeGCCallback` before the one `install()`
        or `TRL_GC_PLUGIN=1` registered (its settings are the user's for this Trainer), else the first to arrive."""
        owner = _OWNERS.get(state)
        if owner is None:
            peers = _explicit_callbacks_of_this_trainer() if self.auto_registered else []
            owner = next((p for p in peers if p is not self), self)
            _OWNERS.set(state, owner)
        return owner

    def _become_passive(self, owner: SafeGCCallback) -> None:
        """Registered twice (explicitly and through TRL_GC_PLUGIN / install()): one instance acts."""
        self._active = False
        self._owner = owner
        if owner.mode != self.mode:
            report.note(
                f"SafeGCCallback is registered twice for this Trainer: the one passed to the Trainer acts "
                f"(mode={owner.mode}); the one from install()/TRL_GC_PLUGIN (mode={self.mode}) stands by.",
                "warning",
            )


def _explicit_callbacks_of_this_trainer() -> list[SafeGCCallback]:
    """The `SafeGCCallback`s passed explicitly to the Trainer whose callback handler is calling us now (read-only
    look at the calling `CallbackHandler.call_event` frame; empty if it cannot be found)."""
    callbacks = getattr(tracker.calling_handler(), "callbacks", None)
    return [c for c in callbacks or () if isinstance(c, SafeGCCallback) and not c.auto_registered]


class AutoSafeGCCallback(SafeGCCallback):
    """The class `install()` and `TRL_GC_PLUGIN=1` put in `transformers.trainer.DEFAULT_CALLBACKS`."""

    auto_registered = True
