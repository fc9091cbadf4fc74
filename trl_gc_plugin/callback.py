"""`SafeGCCallback`: decides, fixes and verifies gradient checkpointing for one Trainer."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from transformers import TrainerCallback

from . import ckpt, drift, first_step, probe, report, settings, tracker, verify
from ._weak import WeakIdMap
from .apply import CacheSwitch
from .decisions import Decision
from .engine import decide
from .errors import GCConfigError
from .facts import Facts
from .first_forward import FirstForward, TwoForwards, not_running
from .first_step import Parity
from .keep import every_n_pattern
from .modes import Mode
from .observe import Call
from .replay import Replay
from .rules import get_rule
from .runtime_plan import MemoryPlan
from .session import Session, runtime_decision

_OWNERS: WeakIdMap[SafeGCCallback] = WeakIdMap()
"""Which callback acts for a Trainer, keyed by the Trainer's `TrainerState` (kept off the state object itself)."""

F = TypeVar("F", bound=Callable[..., Any])


def _guarded(event: F) -> F:
    """A plugin bug never stops training: anything but a deliberate `GCConfigError` is logged once and the callback
    stands down for the rest of the run."""

    @functools.wraps(event)
    def wrapper(self: SafeGCCallback, *args: Any, **kwargs: Any) -> Any:
        if self._broken:
            return None
        try:
            return event(self, *args, **kwargs)
        except GCConfigError:
            raise
        except Exception as exc:
            self._broken = True
            self._active = False
            self._stop_watching()
            report.note(
                f"internal error in {event.__name__} ({type(exc).__name__}: {exc}); training goes on without the "
                "plugin's checks. Please report it.",
                "warning",
            )
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

    def __init__(
        self,
        mode: str | None = None,
        write_json: bool = True,
        audit: bool | None = None,
        parity_check: bool | None = None,
        memory_budget: str | int | None = None,
    ) -> None:
        from .patching import installed_settings

        resolved = settings.GCSettings.resolve(
            {
                "mode": mode,
                "write_json": write_json,
                "audit": audit,
                "parity_check": parity_check,
                "memory_budget": memory_budget,
            },
            installed_settings(),
        )
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
        for line in resolved.problems:
            report.note(f"{line}; using the default.", "warning")

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
        return self._owner.decisions if self._owner is not None else self._session.decisions

    @decisions.setter
    def decisions(self, value: list[Decision]) -> None:
        self._session.decisions = value

    @property
    def observed(self) -> dict[str, Call]:
        """What the first training forward passed to each checkpointed block (`observe.Call` by block name)."""
        return self._first_forward.observed if self._first_forward is not None else {}

    @property
    def plan_check(self) -> Any:
        """With a memory budget: the plan's predicted saved bytes against those the first training forward saved."""
        return self._memory_plan.comparison if self._memory_plan is not None else None

    def _reset_run(self) -> None:
        self._session = Session(self.mode, self.write_json)
        self._cache_off = False
        self._every_n: int | None = None
        self._first_forward: FirstForward | None = None
        self._parity: Parity | None = None
        self._memory_plan: MemoryPlan | None = None
        self._audit_pending = False
        self._ddp_needs_every_gradient = False
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
        session = self._session
        session.args = args
        report.follow_trainer(args)
        tracker.move_before_reporters(self)  # a callback passed to the Trainer comes after the reporters
        if model is None:
            return
        facts = probe.facts_from_trainer(args, model, stage="init_end")
        record = probe.get_record(args)  # what the patched __post_init__ decided, when it ran
        session.decisions = list(record.decisions) if record is not None else []
        session.final = (facts.use_reentrant, facts.use_reentrant_source)
        decisions = decide(facts, self.mode)
        session.take(decisions, model)
        self._cache_off = any(d.applied and d.setting == "model.config.use_cache" for d in decisions)
        if any(d.applied and d.setting == "checkpointing_kwargs" for d in decisions):
            self._every_n = facts.every_n_layers  # transformers < 5.23: the plugin applies it itself
        if report.is_main_process(args):
            report.logger.info(report.summary_line(session.decisions, self.mode, *session.final, session.json_path))

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
        logs.update(tracker.summary(self.decisions, *self._session.final, self.mode, self.plan_check, text))

    @_guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Checkpointing is live now: check the model runs what was decided; repair it when it does not. Then install
        the first step's checks."""
        if not self._active or model is None:
            return
        session = self._session
        session.args, session.model = args, model
        facts = probe.facts_from_trainer(args, model, stage="train")
        seen = {(d.rule_id, d.action, d.setting, repr(d.before), repr(d.after)) for d in session.decisions}
        decisions = [
            d
            for d in decide(facts, self.mode)
            if d.action != "none" and (d.rule_id, d.action, d.setting, repr(d.before), repr(d.after)) not in seen
        ]
        if decisions:
            session.take(decisions, model)
        if self._cache_off:  # the configs as the Trainer leaves them (transformers 5 writes args.use_cache itself)
            session.cache = CacheSwitch(model)
        self._keep_what_was_enabled(facts, model)
        value = session.final[0]
        if not isinstance(value, bool):  # warn mode or a stand-back left it unset: watch what actually runs
            value = probe.model_use_reentrant(model)
        if isinstance(value, bool):
            session.watch = verify.Watch(args, model, value)
        self._asked_vs_running(args, model)
        # DDP as the Trainer wraps it with checkpointing on: no find_unused_parameters, no static graph
        self._ddp_needs_every_gradient = bool(
            facts.gc_enabled and facts.ddp and not facts.ddp_find_unused and not facts.ddp_static_graph
        )
        if probe.checkpointing_on(model):  # the runtime checks run even when the plugin stands back from deciding
            self._install_first_step_checks(args, model, facts)

    def _install_first_step_checks(self, args: Any, model: Any, facts: Facts) -> None:
        """The memory plan and the first step's checks. Under `torch.compile` nothing is hooked into the forward
        (a hook there breaks the compiled graph: rule `torch-compile-first-step`): the audit reads the gradients after
        the backward; the memory plan and the automatic parity probe are off."""
        session = self._session
        compiled = probe.compiled(args, model)
        if compiled:
            rule = get_rule("torch-compile-first-step")
            reason = f"{compiled}: " + rule.message
            session.record([runtime_decision(rule, "none", None, None, reason, level="info")])
        if self.memory_budget is not None and not session.stands_back():
            if compiled:
                why = (
                    f"No memory plan: {compiled}, and the estimate runs the eager forward; checkpointing runs as asked."
                )
                session.record([runtime_decision(get_rule("memory-plan"), "warn", None, None, why, level="warning")])
            else:
                self._memory_plan = self._install(MemoryPlan(session, self.memory_budget), model)
        self._audit_pending = self.audit
        if compiled:
            if self.parity_check:  # asked for: on a synthetic batch (the first inputs are read by a forward hook)
                self._parity = Parity(session, forced=True)
            return
        if facts.reduces_per_parameter and probe.model_use_reentrant(model):
            self._install(TwoForwards(session), model)
        self._first_forward = self._install(FirstForward(session), model)
        self._install(Replay(session), model)
        if Parity.possible(self.parity_check, args, model):
            forced = Parity.forced(self.parity_check, args, model)
            if forced or self.audit:  # without the audit only a forced probe runs: keep no inputs for nothing
                self._parity = self._install(Parity(session, forced), model)

    @_guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session.cache is not None:
            self._session.cache.off()

    @_guarded
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            return
        result = None
        if self._audit_pending:
            self._audit_pending = False
            observation = self._first_forward.observation if self._first_forward is not None else None
            result = first_step.gradients(self._session, model, observation)
        parity, self._parity = self._parity, None
        probe_follows = parity is not None and (parity.forced or (result is not None and result.suspicious))
        if result is not None:
            first_step.audit(self._session, result, probe_follows)
        if self._ddp_needs_every_gradient:  # the first optimizer step only
            self._ddp_needs_every_gradient = False
            first_step.ddp_unused(self._session, model)
        if parity is not None and probe_follows:
            parity.run(model)
        elif parity is not None:
            parity.remove()

    @_guarded
    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        session = self._session
        if session.cache is not None:
            session.cache.restore()  # a checkpoint saved after this step keeps the user's config
        for check in [c for c in session.checks if isinstance(c, (TwoForwards, Parity, Replay))]:
            check.remove()  # the first step is over (a parity probe still pending runs on a synthetic batch)
        if self._first_forward is not None:  # nothing of the observation stays
            self._first_forward.finish(self._asked(args))
        drift.check(session)

    @_guarded
    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self._active:
            return
        self._stop_watching()
        repeats = {k: n for k, n in self._session.reported.items() if n > 1}
        if repeats:
            report.note(
                f"repeated during training (first occurrence logged above): {repeats}",
                "info",
                report.is_main_process(args),
            )

    # --- train begin ---------------------------------------------------------------------------------------------

    def _install(self, check: Any, model: Any) -> Any:
        check.install(model)
        self._session.checks.append(check)
        return check

    @staticmethod
    def _asked(args: Any) -> bool:
        return bool(getattr(args, probe.flag_field(args), False))

    def _asked_vs_running(self, args: Any, model: Any) -> None:
        """Checkpointing asked for but not running (memory), or running without being asked for (speed)."""
        asked, running = self._asked(args), probe.checkpointing_on(model)
        if asked and not running:
            not_running(self._session, "no block has checkpointing switched on at train begin")
        elif running and not asked and not self._launcher_checkpoints(model):
            rule = get_rule("checkpointing-unasked")
            blocks = sum(probe.block_pattern(model))
            reason = (
                f"{blocks} block(s) checkpoint although the arguments say activation_checkpointing=False. "
                + rule.message
            )
            self._session.record([runtime_decision(rule, "warn", False, True, reason, level="info")])

    @staticmethod
    def _launcher_checkpoints(model: Any) -> bool:
        """A launcher's own checkpoint function runs (`ckpt.wrapped`): it enabled checkpointing on purpose (LLaMA-Factory
        does on the model, by default, with the Trainer's flag false), so it is asked for, by the launcher."""
        return any(ckpt.wrapped(f) for _, f in ckpt.functions(probe.unwrap(model)))

    def _keep_what_was_enabled(self, facts: Facts, model: Any) -> None:
        """Apply `every_n_layers` where transformers cannot (before 5.16), and keep the layer pattern, the offload
        wrapper and the plugin's keywords across re-enables (TRL's DPO/GRPO/KTO/RLOO re-enable with the raw kwargs
        every step)."""
        if self._session.stands_back() or not probe.checkpointing_on(model):
            return
        layer_kwargs = probe.reads_layer_kwargs(facts.caps)
        every_n = None if "every_n_layers" in layer_kwargs else self._every_n
        if every_n:
            blocks = ckpt.blocks(probe.unwrap(model))
            ckpt.apply(model, ckpt.Spec(pattern=every_n_pattern(len(blocks), every_n)))
        if every_n or (layer_kwargs and (facts.every_n_layers or facts.offload)):
            self._session.ensure_guard(layer_kwargs)

    def _stop_watching(self) -> None:
        """Remove every trace of the run from the model (checks' hooks, the enable guard) and its config
        (use_cache)."""
        self._session.stop()
        if self._first_forward is not None:
            self._first_forward.remove()
        self._parity = None

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
        self._session.watch = None
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
    try:
        frame = sys._getframe(1)
        for _ in range(6):
            if frame is None:
                break
            handler = frame.f_locals.get("self")
            callbacks = getattr(handler, "callbacks", None)
            if type(handler).__name__ == "CallbackHandler" and isinstance(callbacks, list):
                return [c for c in callbacks if isinstance(c, SafeGCCallback) and not c.auto_registered]
            frame = frame.f_back
    except Exception:  # never let the look fail the run
        pass
    return []


class AutoSafeGCCallback(SafeGCCallback):
    """The class `install()` and `TRL_GC_PLUGIN=1` put in `transformers.trainer.DEFAULT_CALLBACKS`."""

    auto_registered = True
