"""`Run`: the plugin's runtime for one training run, whatever drives it.

A route maps its events onto a `Run`: the Trainer route (`callback.SafeGCCallback`: `on_init_end`, `on_train_begin`,
`on_pre_optimizer_step`, ...) and the model route (`loop.py`: `gradient_checkpointing_enable` and the first forward
and optimizer step of a loop without a Trainer). The stages are the same for both:

1. `init(args, model)`: read the facts, decide, refuse or apply, log the summary line;
2. `begin(args, model)`: checkpointing is live: repair what does not run as decided, keep it across re-enables, and
   install the first step's checks (first forward, replay, two forwards, parity, memory plan);
3. `before_optimizer_step(model)`: the gradient audit, DDP's unused parameters and the parity probe, before any
   parameter update;
4. `step_end(args)`: the first step's checks go; drift and hook pile-ups are checked every step;
5. `stop()`: nothing of the run stays on the model.
"""

from __future__ import annotations

from typing import Any

from .._base import report
from ..core.decisions import Decision
from ..core.engine import decide
from ..core.facts import Facts
from ..core.rules import get_rule
from ..core.settings import GCSettings
from ..model import ckpt, probe
from ..model.enable_guard import every_n_pattern
from ..model.verify import Watch
from ..model.write import CacheSwitch, set_args_kwarg
from . import drift, first_step
from .first_forward import FirstForward, TwoForwards, not_running
from .first_step import Parity
from .memory_plan import MemoryPlan, no_plan
from .replay import Replay
from .session import Session, runtime_decision


class Run:
    """The runtime of one run: its `Session` (decisions, the `use_reentrant` in force) and its checks.

    Args:
        settings (`GCSettings`): the resolved settings (mode, audit, parity probe, memory budget, decisions file).
        cache_switch (`bool`, *optional*, defaults to `True`): turn `use_cache` off for each training step and back
            for saves when a rule decides so (the Trainer route; a loop without a Trainer has no step events, and
            transformers turns the cache off itself there).
        offloader (`str`, *optional*): a launcher's activation offloading that replaces the Trainer's checkpointing
            (Axolotl's), said at train begin instead of the `checkpointing-unasked` finding.
        route_facts (`dict`, *optional*): facts the route knows better than the probe (`loop.ROUTE_FACTS`).
    """

    def __init__(
        self,
        settings: GCSettings,
        cache_switch: bool = True,
        offloader: str | None = None,
        route_facts: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.session = Session(settings.mode, settings.write_json)
        self.cache_switch = cache_switch
        self.cache_off = False
        self.every_n: int | None = None
        self.first_forward: FirstForward | None = None
        self.parity: Parity | None = None
        self.memory_plan: MemoryPlan | None = None
        self.audit_pending = False
        self.ddp_needs_every_gradient = False
        self.offloader = offloader
        self.route_facts = dict(route_facts or {})

    @property
    def decisions(self) -> list[Decision]:
        return self.session.decisions

    # --- 1. decide -----------------------------------------------------------------------------------------------

    def init(self, args: Any, model: Any, previous: list[Decision] | None = None) -> list[Decision]:
        """Decide for the arguments and the model (stage `init_end`), after `previous` decisions of the same run
        (those of the patched `__post_init__`); refuse, or apply and log the summary line. Returns the new ones."""
        session = self.session
        session.args = args
        previous = _withdraw_default_under_launcher(args, model, list(previous or []))
        facts = probe.facts_from_trainer(args, model, stage="init_end").replace(**self.route_facts)
        session.decisions = previous
        session.final = (facts.use_reentrant, facts.use_reentrant_source)
        decisions = decide(facts, session.mode)
        session.take(decisions, model)
        self.cache_off = any(d.applied and d.setting == "model.config.use_cache" for d in decisions)
        if any(d.applied and d.setting == "checkpointing_kwargs" for d in decisions):
            self.every_n = facts.every_n_layers  # transformers < 5.23: the plugin applies it itself
        if report.is_main_process(args):
            report.logger.info(report.summary_line(session.decisions, session.mode, *session.final, session.json_path))
        return decisions

    # --- 2. checkpointing is live --------------------------------------------------------------------------------

    def begin(self, args: Any, model: Any, asked: bool) -> None:
        """Check the model runs what was decided and repair it when it does not; keep it across re-enables; install
        the first step's checks. `asked`: the run asked for checkpointing (the Trainer's flag, or the loop's
        enable call)."""
        session = self.session
        session.args, session.model = args, model
        facts = probe.facts_from_trainer(args, model, stage="train").replace(**self.route_facts)
        seen = {_key(d) for d in session.decisions}
        decisions = [d for d in decide(facts, session.mode) if d.action != "none" and _key(d) not in seen]
        if decisions:
            session.take(decisions, model)
        if self.cache_off and self.cache_switch:  # the configs as the Trainer leaves them
            session.cache = CacheSwitch(model)
        self._keep_what_was_enabled(facts, model)
        value = session.final[0]
        if not isinstance(value, bool):  # warn mode or a stand-back left it unset: watch what actually runs
            value = ckpt.model_use_reentrant(model)
        if isinstance(value, bool):
            session.watch = Watch(args, model, value)
        self._asked_vs_running(asked, model)
        # DDP as the Trainer wraps it with checkpointing on: no find_unused_parameters, no static graph
        self.ddp_needs_every_gradient = bool(
            facts.gc_enabled and facts.ddp and not facts.ddp_find_unused and not facts.ddp_static_graph
        )
        if probe.checkpointing_on(model):  # the runtime checks run even when the plugin stands back from deciding
            self._install_first_step_checks(args, model, facts)

    def _install_first_step_checks(self, args: Any, model: Any, facts: Facts) -> None:
        """The memory plan and the first step's checks. Under `torch.compile` nothing is hooked into the forward
        (a hook there breaks the compiled graph: rule `torch-compile-first-step`): the audit reads the gradients after
        the backward; the memory plan and the automatic parity probe are off."""
        session, settings = self.session, self.settings
        compiled = facts.compiled  # said at init_end by rule `torch-compile-first-step`
        if settings.memory_budget is not None and not session.stands_back():
            if compiled:
                session.record([no_plan(f"{compiled}, and the estimate runs the eager forward")])
            else:
                self.memory_plan = self._install(MemoryPlan(session, settings.memory_budget), model)
        self.audit_pending = settings.audit
        if compiled:
            if settings.parity_check:  # asked for: on a synthetic batch (the first inputs are read by a forward hook)
                self.parity = Parity(session, forced=True)
            return
        if facts.reduces_per_parameter and ckpt.model_use_reentrant(model):
            self._install(TwoForwards(session), model)
        self.first_forward = self._install(FirstForward(session), model)
        self._install(Replay(session), model)
        if Parity.possible(settings.parity_check, args, model):
            forced = Parity.forced(settings.parity_check, args, model)
            if forced or settings.audit:  # without the audit only a forced probe runs: keep no inputs for nothing
                self.parity = self._install(Parity(session, forced), model)

    def _install(self, check: Any, model: Any) -> Any:
        check.install(model)
        self.session.checks.append(check)
        return check

    def _asked_vs_running(self, asked: bool, model: Any) -> None:
        """Checkpointing asked for but not running (memory), or running without being asked for (speed)."""
        running = probe.checkpointing_on(model)
        if self.offloader is not None:
            blocks = sum(probe.block_pattern(model)) if running else 0
            report.note(
                f"{self.offloader}: the launcher turned the Trainer's checkpointing off and checkpoints with its offloader "
                f"({blocks} block(s) with transformers' checkpointing on the model).",
                "info",
                report.is_main_process(self.session.args),
            )
        elif asked and not running:
            not_running(self.session, "no block has checkpointing switched on at train begin")
        elif running and not asked and not _launcher_checkpoints(model):
            rule = get_rule("checkpointing-unasked")
            blocks = sum(probe.block_pattern(model))
            reason = (
                f"{blocks} block(s) checkpoint although the arguments say activation_checkpointing=False. "
                + rule.message
            )
            self.session.record([runtime_decision(rule, "warn", False, True, reason, level="info")])

    def _keep_what_was_enabled(self, facts: Facts, model: Any) -> None:
        """Apply `every_n_layers` where transformers cannot (before 5.16), and keep the layer pattern, the offload
        wrapper and the plugin's keywords across re-enables (TRL's DPO/GRPO/KTO/RLOO re-enable with the raw kwargs
        every step)."""
        if self.session.stands_back() or not probe.checkpointing_on(model):
            return
        layer_kwargs = facts.caps.layer_kwargs()
        every_n = None if "every_n_layers" in layer_kwargs else self.every_n
        if every_n:
            blocks = ckpt.blocks(ckpt.unwrap(model))
            ckpt.apply(model, ckpt.Spec(pattern=every_n_pattern(len(blocks), every_n)))
        if every_n or (layer_kwargs and (facts.every_n_layers or facts.offload)):
            self.session.ensure_guard(layer_kwargs)

    # --- 3.-4. the steps -----------------------------------------------------------------------------------------

    def step_begin(self) -> None:
        if self.session.cache is not None:
            self.session.cache.off()

    def before_optimizer_step(self, model: Any) -> None:
        """The first optimizer step's checks, before any parameter update (each runs once)."""
        session = self.session
        result = None
        if self.audit_pending:
            self.audit_pending = False
            observation = self.first_forward.observation if self.first_forward is not None else None
            result = first_step.gradients(session, model, observation)
        parity, self.parity = self.parity, None
        probe_follows = parity is not None and (parity.forced or (result is not None and result.suspicious))
        if result is not None:
            first_step.audit(session, result, probe_follows)
        if self.ddp_needs_every_gradient:  # the first optimizer step only
            self.ddp_needs_every_gradient = False
            first_step.ddp_unused(session, model)
        if parity is not None and probe_follows:
            parity.run(model)
        elif parity is not None:
            parity.remove()

    def step_end(self, asked: bool) -> None:
        session = self.session
        if session.cache is not None:
            session.cache.restore()  # a checkpoint saved after this step keeps the user's config
        for check in [c for c in session.checks if isinstance(c, (TwoForwards, Parity, Replay))]:
            check.remove()  # the first step is over (a parity probe still pending runs on a synthetic batch)
        if self.first_forward is not None:  # nothing of the observation stays
            self.first_forward.finish(asked)
        drift.check(session)

    # --- 5. the end ----------------------------------------------------------------------------------------------

    def stop(self, keep_repairs: bool = False) -> None:
        """Remove every trace of the run from the model (checks' hooks, the enable guard, its repairs unless
        `keep_repairs`) and its config (use_cache)."""
        self.session.stop(keep_repairs)
        if self.first_forward is not None:
            self.first_forward.remove()
        self.parity = None

    def say_repeats(self, main_process: bool) -> None:
        repeats = {k: n for k, n in self.session.reported.items() if n > 1}
        if repeats:
            report.note(f"repeated during training (first occurrence logged above): {repeats}", "info", main_process)


def _withdraw_default_under_launcher(args: Any, model: Any, previous: list[Decision]) -> list[Decision]:
    """The model already checkpoints through a launcher's own function (LLaMA-Factory's wrapper, `ckpt.wrapped`), with
    the launcher's `use_reentrant`, the launcher replaced the model's `gradient_checkpointing_enable` (LLaMA-Factory
    does), and the arguments hold only the plugin's post-init default (nobody wrote one): the default goes, so the
    launcher's value is the one in force, as it is when the Trainer's flag is off and as `trl-gc-check` reads it (the
    Trainer's re-enable then goes through the launcher's enable with its default)."""
    record = probe.get_record(args)
    if record is None or record.value_source != "plugin" or record.user_given:
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
