"""`Run`: one training run as the plugin sees it, whatever route drives it.

A route maps its events onto a `Run` created with the settings it resolved (a bad setting is refused or said before
anything is armed): the Trainer callback (`on_init_end`, `on_train_begin`, `on_pre_optimizer_step`, ...), the
`TrainingArguments.__post_init__` patch (stage 1 only), and the model route of a loop without a Trainer (its enable
call, its first training forward and first optimizer step). The stages are the same for all:

1. `decide(args, model)`: read the facts, decide (`engine.decide`), refuse or apply, log the summary line;
2. `begin(args, model, asked)`: checkpointing is live: repair what does not run as decided, keep it across
   re-enables; `arm_first_step(args, model)`: the first step's checks (first forward, replay, two forwards, parity,
   memory plan);
3. `before_optimizer_step(model)`: the gradient audit, DDP's unused parameters and the parity probe, before any
   parameter update;
4. `step_end(asked)`: the first step's checks go; drift and hook pile-ups are checked every step (and at every
   re-enable, `reenabled()`);
5. `stop()`: every hook of the run goes (`Record.hooks`), on every exit path.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from .._base import report
from ..core.decisions import Decision, Decisions
from ..core.engine import decide
from ..core.errors import internal_error
from ..core.facts import Facts
from ..core.layout import Layout, every_n_pattern
from ..core.rules import get_rule
from ..core.settings import GCSettings
from ..model import ckpt, probe
from ..model.verify import Watch
from ..model.write import CacheSwitch, apply, remove_input_hook, set_args_kwarg
from . import drift, first_step
from .first_forward import FirstForward, TwoForwards, not_running
from .first_step import Parity
from .memory_plan import MemoryPlan, no_plan
from .record import Record, runtime_decision
from .replay import Replay


class Run(Record):
    """One run: its record (decisions, the `use_reentrant` in force, its hooks) and its stages.

    Args:
        settings (`GCSettings`): the resolved settings (mode, audit, parity probe, memory budget, decisions file).
        cache_switch (`bool`, *optional*, defaults to `True`): turn `use_cache` off for each training step and back
            for saves when a rule decides so (the Trainer route; a loop without a Trainer has no step events, and
            transformers turns the cache off itself there).
        offloader (`str`, *optional*): a launcher's activation offloading that replaces the Trainer's checkpointing
            (Axolotl's), said at train begin instead of the `checkpointing-unasked` finding.
        route_facts (`dict`, *optional*): facts the route knows better than the probe (the model route's).
        main_process / write_json: as `Record`'s.
    """

    def __init__(
        self,
        settings: GCSettings,
        cache_switch: bool = True,
        offloader: str | None = None,
        route_facts: dict[str, Any] | None = None,
        main_process: bool | None = None,
        write_json: bool = True,
    ) -> None:
        super().__init__(settings, main_process, write_json)
        self.cache_switch = cache_switch
        self.cache_off = False
        self.every_n: int | None = None
        self.first_forward: FirstForward | None = None
        self.replay: Replay | None = None
        self.parity: Parity | None = None
        self.memory_plan: MemoryPlan | None = None
        self.first_step_checks: list[Any] = []
        self.audit_pending = False
        self.ddp_needs_every_gradient = False
        self.offloader = offloader
        self.route_facts = dict(route_facts or {})

    # --- 1. decide -----------------------------------------------------------------------------------------------

    def decide(
        self, args: Any, model: Any, previous: list[Decision] | None = None, stage: str = "init_end"
    ) -> Decisions:
        """Decide for the arguments and the model (the model is None at stage `post_init`), after `previous`
        decisions of the same run (the patched `__post_init__`'s); refuse, or apply and log. Returns the new ones."""
        self.args = args
        if stage == "post_init":
            self.decisions = list(previous or [])
        else:
            self.decisions = _withdraw_default_under_launcher(args, model, list(previous or []))
        facts = self._facts(args, model, stage)
        self.set_use_reentrant(facts.use_reentrant, facts.use_reentrant_source)
        decisions = decide(facts, self.mode)
        self.take(decisions, model)
        if stage == "post_init":
            return decisions
        self.cache_off = any(d.applied and d.setting == "model.config.use_cache" for d in decisions)
        if any(d.applied and d.setting == "checkpointing_kwargs" for d in decisions):
            self.every_n = facts.every_n_layers  # transformers < 5.23: the plugin applies it itself
        if self.is_main():
            line = report.summary_line(self.decisions, self.mode, self.use_reentrant, self.source, self.json_path)
            report.logger.info(line)
        return decisions

    def take(self, decisions: list[Decision], model: Any) -> None:
        """A stage's decisions (`engine.decide`): record them, refuse (before anything changes), apply them to the
        arguments and the model, follow the `use_reentrant` they leave in force, and publish them."""
        self.decisions.extend(decisions)
        self.refuse(decisions)
        for d in apply(decisions, self.args, model):
            if d.setting == "inputs_require_grad" and model is not None:
                self.hooks.undo(functools.partial(remove_input_hook, weakref.ref(model)), repair=True)
        if isinstance(decisions, Decisions) and decisions.in_force is not None:
            self.set_use_reentrant(*decisions.in_force)
        self.publish(decisions)

    def _facts(self, args: Any, model: Any, stage: str) -> Facts:
        if model is None:
            return probe.facts_from_args(args, stage=stage)
        return probe.facts_from_trainer(args, model, stage=stage).replace(**self.route_facts)

    # --- 2. checkpointing is live --------------------------------------------------------------------------------

    def begin(self, args: Any, model: Any, asked: bool) -> Facts:
        """Check the model runs what was decided and repair it when it does not; keep it across re-enables; set the
        per-step watch. `asked`: the run asked for checkpointing (the Trainer's flag, or the loop's enable call)."""
        self.args, self.model = args, model
        facts = self._facts(args, model, "train")
        seen = {_key(d) for d in self.decisions}
        decisions = decide(facts, self.mode)
        new = decisions.where(lambda d: d.action != "none" and _key(d) not in seen)
        if new:
            self.take(new, model)
        if self.cache_off and self.cache_switch:  # the configs as the Trainer leaves them
            self.cache = CacheSwitch(model)
        self._keep_what_was_enabled(facts, model)
        value = self.use_reentrant
        if not isinstance(value, bool):  # warn mode or a stand-back left it unset: watch what actually runs
            value = ckpt.model_use_reentrant(model)
        if isinstance(value, bool):
            self.watch = Watch(args, model, baseline=value)
        _asked_vs_running(self, asked, model)
        # DDP as the Trainer wraps it with checkpointing on: no find_unused_parameters, no static graph
        self.ddp_needs_every_gradient = bool(
            facts.gc_enabled and facts.ddp and not facts.ddp_find_unused and not facts.ddp_static_graph
        )
        return facts

    def arm_first_step(self, facts: Facts, model: Any) -> None:
        """The memory plan and the first step's checks, where the model checkpoints (also when the plugin stands
        back from deciding). Under `torch.compile` nothing is hooked into the forward (a hook there breaks the compiled
        graph: rule `torch-compile-first-step`): the audit reads the gradients after the backward; the memory plan and
        the automatic parity probe are off."""
        if not probe.checkpointing_on(model):
            return
        settings, args = self.settings, self.args
        compiled = facts.compiled  # said at init_end by rule `torch-compile-first-step`
        if settings.memory_budget is not None and not self.stands_back():
            if compiled:
                self.record([no_plan(f"{compiled}, and the estimate runs the eager forward")])
            else:
                self.memory_plan = self._check(MemoryPlan(self, settings.memory_budget), model)
        self.audit_pending = settings.audit
        if compiled:
            if settings.parity_check:  # asked for: on a synthetic batch (the first inputs are read by a forward hook)
                self.parity = Parity(self, forced=True)
            return
        if facts.reduces_per_parameter and ckpt.model_use_reentrant(model):
            self._check(TwoForwards(self), model)
        self.first_forward = self._check(FirstForward(self), model)
        self.replay = self._check(Replay(self), model)
        if Parity.possible(settings.parity_check, args, model):
            forced = Parity.forced(settings.parity_check, args, model)
            if forced or settings.audit:  # without the audit only a forced probe runs: keep no inputs for nothing
                self.parity = self._check(Parity(self, forced), model)

    def _check(self, check: Any, model: Any) -> Any:
        check.install(model)
        self.first_step_checks.append(check)
        return check

    def _keep_what_was_enabled(self, facts: Facts, model: Any) -> None:
        """Apply `every_n_layers` where transformers cannot (before 5.16), and keep the layer pattern, the offload
        wrapper and the plugin's keywords across re-enables (TRL's DPO/GRPO/KTO/RLOO re-enable with the raw kwargs
        every step; a loop may re-enable too)."""
        if self.stands_back() or not probe.checkpointing_on(model):
            return
        layer_kwargs = facts.caps.layer_kwargs()
        every_n = None if "every_n_layers" in layer_kwargs else self.every_n
        if every_n:
            blocks = ckpt.blocks(ckpt.unwrap(model))
            ckpt.apply(model, ckpt.Spec(layout=Layout.from_pattern(every_n_pattern(len(blocks), every_n))))
        keep = bool(every_n or (layer_kwargs and (facts.every_n_layers or facts.offload)))
        self.ensure_guard(layer_kwargs, keep)

    def reenabled(self) -> None:
        """The model's checkpointing was enabled again (the enable guard saw it): what drifted is put back now, before
        the next forward runs it."""
        drift.check(self, "when checkpointing was re-enabled")

    # --- 3.-4. the steps -----------------------------------------------------------------------------------------

    def step_begin(self) -> None:
        if self.cache is not None:
            self.cache.off()

    def before_optimizer_step(self, model: Any) -> None:
        """The first optimizer step's checks, before any parameter update (each runs once)."""
        result = None
        if self.audit_pending:
            self.audit_pending = False
            observation = self.first_forward.observation if self.first_forward is not None else None
            result = first_step.gradients(self, model, observation)
        parity, self.parity = self.parity, None
        replayed = self.replay.found if self.replay is not None else None
        self.replay = None
        suspicious = bool(replayed) or (result is not None and result.suspicious)
        probe_follows = parity is not None and (parity.forced or suspicious)
        if result is not None:
            first_step.audit(self, result, probe_follows)
        if self.ddp_needs_every_gradient:  # the first optimizer step only
            self.ddp_needs_every_gradient = False
            first_step.ddp_unused(self, model)
        if parity is not None and probe_follows:
            parity.run(model, replayed or [])
        elif parity is not None:
            parity.remove()

    def step_end(self, asked: bool) -> None:
        if self.cache is not None:
            self.cache.restore()  # a checkpoint saved after this step keeps the user's config
        if self.first_forward is not None:  # what was observed stays, nothing of the observation
            self.first_forward.finish(asked)
        checks, self.first_step_checks = self.first_step_checks, []
        for check in checks:
            if check is not self.memory_plan:  # its check of the first forward removes itself, its hooks go at stop
                check.remove()  # the first step is over (a parity probe still pending runs on a synthetic batch)
        drift.check(self)

    @property
    def first_step_pending(self) -> bool:
        """The first step's checks are armed and have not all run."""
        return bool(self.first_step_checks) or self.audit_pending

    # --- 5. the end ----------------------------------------------------------------------------------------------

    def stop(self, keep_lasting: bool = False, keep_repairs: bool = False) -> None:
        checks, self.first_step_checks = self.first_step_checks, []
        for check in checks:  # what a check put in place for one forward (the observer) goes back first
            check.remove()
        super().stop(keep_lasting, keep_repairs)
        self.parity = None
        self.replay = None
        self.audit_pending = False

    def finish(self, why_unchecked: str) -> None:
        """The run is over: say what was repeated, and once, why its first step went unchecked if it did (`why`),
        then every hook of the run goes."""
        if self.first_step_pending and not self.stopped:
            report.note(f"the first-step checks did not run: {why_unchecked}.", "info", self.is_main())
        repeats = {k: n for k, n in self.reported.items() if n > 1}
        if repeats:
            report.note(f"repeated during training (first occurrence logged above): {repeats}", "info", self.is_main())
        self.stop()

    def fail(self, exc: Exception, where: str) -> None:
        """A plugin bug in `where`: said once; every hook of the run goes and training goes on without them."""
        report.note(internal_error(where, exc), "warning")
        self.stop()


def _asked_vs_running(run: Run, asked: bool, model: Any) -> None:
    """Checkpointing asked for but not running (memory), or running without being asked for (speed)."""
    running = probe.checkpointing_on(model)
    if run.offloader is not None:
        blocks = sum(probe.block_pattern(model)) if running else 0
        report.note(
            f"{run.offloader}: the launcher turned the Trainer's checkpointing off and checkpoints with its offloader "
            f"({blocks} block(s) with transformers' checkpointing on the model).",
            "info",
            run.is_main(),
        )
    elif asked and not running:
        not_running(run, "no block has checkpointing switched on at train begin")
    elif running and not asked and not _launcher_checkpoints(model):
        rule = get_rule("checkpointing-unasked")
        blocks = sum(probe.block_pattern(model))
        reason = (
            f"{blocks} block(s) checkpoint although the arguments say activation_checkpointing=False. " + rule.message
        )
        run.record([runtime_decision(rule, "warn", False, True, reason, level="info")])


def _withdraw_default_under_launcher(args: Any, model: Any, previous: list[Decision]) -> list[Decision]:
    """The model already checkpoints through a launcher's own function (LLaMA-Factory's wrapper, `ckpt.wrapped`), with
    the launcher's `use_reentrant`, the launcher replaced the model's `gradient_checkpointing_enable` (LLaMA-Factory
    does), and the arguments hold only the plugin's post-init default (nobody wrote one): the default goes, so the
    launcher's value is the one in force, as it is when the Trainer's flag is off and as `trl-gc-check` reads it (the
    Trainer's re-enable then goes through the launcher's enable with its default)."""
    record = probe.get_record(args)
    if record is None or record.value_source != "plugin" or record.user_given or model is None:
        return previous
    if not _launcher_checkpoints(model):
        return previous
    if "gradient_checkpointing_enable" not in vars(ckpt.unwrap(model)):  # the Trainer's re-enable skips the launcher
        return previous
    set_args_kwarg(args, "use_reentrant", None)
    probe.remember(args, None, "unset")
    return [d for d in previous if not (d.setting == "use_reentrant" and d.applied)]


def _key(d: Decision) -> tuple[Any, ...]:
    return (d.rule_id, d.action, d.setting, repr(d.before), repr(d.after))


def _launcher_checkpoints(model: Any) -> bool:
    """A launcher's own checkpoint function runs (`ckpt.wrapped`): it enabled checkpointing on purpose (LLaMA-Factory
    does on the model, by default, with the Trainer's flag false), so it is asked for, by the launcher."""
    return any(ckpt.wrapped(f) for _, f in ckpt.functions(ckpt.unwrap(model)))
