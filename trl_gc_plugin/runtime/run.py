"""`Run`: one training run as the plugin sees it, whatever route drives it (the Trainer callback, the patched
`TrainingArguments.__post_init__`, a loop's model route). Its stages: `decide`; `begin` and `arm_first_step`;
`before_optimizer_step`; `step_end` (and `reenabled`); `stop`, which removes every hook of the run on every exit path.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
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
from ..model.write import UNDO, CacheSwitch, apply, write_use_reentrant
from . import drift, first_step
from .first_forward import FirstForward, TwoForwards, not_running
from .first_step import Parity
from .memory_plan import MemoryPlan, no_plan
from .record import Record, runtime_decision
from .replay import Replay


@dataclass
class Kept:
    """What a copy of a run keeps of its memory plan: the comparison with the first forward."""

    comparison: Any = None


class Run(Record):
    """A run's record and its stages. `cache_switch`: `use_cache` off for each training step when a rule decides so
    (a loop has no step events; transformers turns it off there); `offloader`: a launcher's activation offloading that
    replaces the Trainer's checkpointing (Axolotl's); `route_facts`: facts the route knows better than the probe."""

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
        self.faithful_undo: Any = None
        self.faithful_said: set[str] = set()
        self.faithful_off = False
        self.router_shapes: frozenset[tuple[int, int]] | None = None
        self.faithful_before: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] | None = None

    LIVE = (*Record.LIVE, "first_forward", "replay", "parity", "memory_plan", "first_step_checks")

    def __getstate__(self) -> dict[str, Any]:
        """What was decided and observed; no check, hook or model (see `Record.LIVE`)."""
        state = super().__getstate__()
        state.update(first_step_checks=[], audit_pending=False, ddp_needs_every_gradient=False, faithful_undo=None)
        state["faithful_before"] = None
        if self.first_forward is not None:  # what the first forward showed (`SafeGCCallback.observed`)
            seen = FirstForward(self)
            seen.observed = dict(self.first_forward.observed)
            state["first_forward"] = seen
        if self.memory_plan is not None:  # the plan's check against the first forward (`plan_check`)
            state["memory_plan"] = Kept(self.memory_plan.comparison)
        return state

    def decide(
        self, args: Any, model: Any, previous: list[Decision] | None = None, stage: str = "init_end"
    ) -> Decisions:
        """Decide after `previous` decisions of the run (`__post_init__`'s; no model there); refuse or apply."""
        self.args = args
        self.decisions = list(previous or [])
        if _launcher_default_to_withdraw(args, model):  # no model at post_init
            write_use_reentrant(args, None, None)
            self.reentrant.hold(None, "unset", args)
            self.decisions = [d for d in self.decisions if not (d.setting == "use_reentrant" and d.applied)]
        facts = self._facts(args, model, stage)
        self.reentrant.hold(facts.use_reentrant, facts.use_reentrant_source, args)
        decisions = decide(facts, self.mode)
        self.take(decisions, model)
        if stage == "post_init":
            return decisions
        self.cache_off = any(d.applied and d.setting == "model.config.use_cache" for d in decisions)
        if any(d.applied and d.setting == "checkpointing_kwargs" for d in decisions):
            self.every_n = facts.every_n_layers  # transformers < 5.23: the plugin applies it itself
        if self.is_main():  # checkpointing off: nothing to say at the default level
            held = self.reentrant
            line = report.summary_line(self.decisions, self.mode, held.value, held.source, self.json_path)
            off = any(d.rule_id == "checkpointing-off" for d in self.decisions)
            report.logger.log(logging.DEBUG if off else logging.INFO, line)
        return decisions

    def take(self, decisions: list[Decision], model: Any) -> None:
        """Record a stage's decisions, refuse (before anything changes), apply, and publish them."""
        self.decisions.extend(decisions)
        self.refuse(decisions)
        for d in apply(decisions, self.args, model):
            undo = UNDO.get(d.setting)
            if undo is not None and model is not None:
                self.hooks.undo(functools.partial(undo, weakref.ref(model)), repair=True)
        if isinstance(decisions, Decisions) and decisions.in_force is not None:
            self.reentrant.hold(*decisions.in_force, self.args)
        self.publish(decisions)

    def _facts(self, args: Any, model: Any, stage: str) -> Facts:
        if model is None:
            return probe.facts_from_args(args, stage=stage)
        return probe.facts_from_trainer(args, model, stage=stage).replace(**self.route_facts)

    def begin(self, args: Any, model: Any, asked: bool) -> Facts:
        """Checkpointing is live: repair what does not run as decided, keep it across re-enables, watch for drift."""
        self.args, self.model = args, model
        facts = self._facts(args, model, "train")
        seen = {_key(d) for d in self.decisions}
        decisions = decide(facts, self.mode)
        new = decisions.where(lambda d: d.action != "none" and _key(d) not in seen)
        if new:
            self.take(new, model)
            whole = decisions.in_force  # what the whole stage leaves in force, decisions already seen included
            if new.in_force is not None and whole is not None:
                self.reentrant.hold(*whole, args)
        if self.cache_off and self.cache_switch:  # the configs as the Trainer leaves them
            self.cache = CacheSwitch(model)
        self._keep_what_was_enabled(facts, model)
        self.keep_recompute_faithful(model, facts)
        value = self.reentrant.value
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
        """The memory plan and the first step's checks; under `torch.compile` nothing is hooked into the forward."""
        if not probe.checkpointing_on(model):
            return
        settings, args = self.settings, self.args
        compiled = facts.compiled  # said at init_end by rule `torch-compile-first-step`
        if settings.memory_budget is not None and not self.stands_back():
            if compiled:  # planned before the first forward, from the arguments' shape (it would be traced)
                self.memory_plan = MemoryPlan(self, settings.memory_budget)
                self.memory_plan.install_compiled(model, compiled)
            elif facts.fp8:  # rule `fp8-checkpointing`: what FP8 blocks keep is not what the estimate counts
                self.record(
                    [no_plan(f"the model trains in FP8 ({facts.fp8}), whose activations the planner cannot price")]
                )
            else:
                self.memory_plan = MemoryPlan(self, settings.memory_budget)  # its hooks go at stop
                self.memory_plan.install(model)
        self.audit_pending = settings.audit
        if compiled:
            if settings.parity_check:  # asked for: on a synthetic batch (the first inputs are read by a forward hook)
                self.parity = Parity(self, forced=True)
            return
        if facts.reduces_per_parameter and ckpt.model_use_reentrant(model):
            self._check(TwoForwards(self), model)
        self.first_forward = self._check(FirstForward(self), model)
        self.replay = self._check(Replay(self), model)
        possible, forced = first_step.parity_wanted(settings.parity_check, args, model)
        if possible and (forced or settings.audit):  # without the audit only a forced probe runs
            self.parity = self._check(Parity(self, forced), model)

    def _check(self, check: Any, model: Any) -> Any:
        check.install(model)
        self.first_step_checks.append(check)
        return check

    def _keep_what_was_enabled(self, facts: Facts, model: Any) -> None:
        """Apply `every_n_layers` where transformers cannot (before 5.16), and keep the layer pattern, the offload
        wrapper and the plugin's keywords across re-enables (TRL's DPO/GRPO/KTO/RLOO re-enable every step)."""
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
        """What drifted at a re-enable is put back before the next forward runs it."""
        drift.check(self, "when checkpointing was re-enabled")
        self.keep_recompute_faithful(self.model)

    def switch(self, value: bool) -> None:
        super().switch(value)
        self.keep_recompute_faithful(self.model)

    def keep_recompute_faithful(self, model: Any, facts: Facts | None = None) -> None:
        """Every non-reentrant block recomputes as its forward ran (`ckpt.faithful_blocks`): the MoE router's logits
        kept, the attention backend replayed; said once where the routing stays recomputed. Not under `torch.compile`
        (dynamo takes only a plain function as `context_fn`; `facts` of the train stage tell, and are remembered for
        the re-enables) nor where another library owns checkpointing."""
        if facts is not None:
            self.faithful_off = bool(facts.compiled)
        if model is None or self.stands_back() or self.stopped or self.faithful_off:
            return
        if self.router_shapes is None:  # once per run: the re-enables of every step walk only the blocks
            self.router_shapes = ckpt.router_shapes(model)
        if self.faithful_before is None:
            self.faithful_before = weakref.WeakKeyDictionary()
        changed, routed, unrouted = ckpt.faithful_blocks(model, self.router_shapes, self.faithful_before)
        if changed and self.faithful_undo is None:
            undo = functools.partial(_unfaithful, weakref.ref(model), self.faithful_before)
            self.faithful_undo = self.hooks.undo(undo, repair=True)
        if routed:
            self._say_routing(
                "kept",
                "repair",
                "info",
                f"{routed} checkpointed block(s) keep their MoE router's logits from the "
                "forward (tokens x experts values each), so the recompute routes every token to the experts the "
                "forward chose.",
            )
        if unrouted:
            self._say_routing(
                "recomputed",
                "warn",
                "warning",
                f"{unrouted} non-reentrant checkpointed block(s) of this MoE model "
                "recompute their routing in the backward (a context_fn of yours, or no router weight of shape "
                "(experts, hidden) found in the block). " + get_rule("moe-routing-recomputed").message,
            )

    def _say_routing(self, key: str, action: Any, level: Any, reason: str) -> None:
        if key in self.faithful_said:
            return
        self.faithful_said.add(key)
        after = "router logits kept" if key == "kept" else None
        rule = get_rule("moe-routing-recomputed")
        self.record([runtime_decision(rule, action, None, after, reason, level=level)])

    def step_begin(self) -> None:
        if self.cache is not None:
            self.cache.off()

    def before_optimizer_step(self, model: Any) -> None:
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
        self._remove_checks()  # a parity probe still pending runs on a synthetic batch
        drift.check(self)

    @property
    def first_step_pending(self) -> bool:
        return bool(self.first_step_checks) or self.audit_pending

    def _remove_checks(self) -> None:
        checks, self.first_step_checks = self.first_step_checks, []
        for check in checks:
            check.remove()

    def stop(self, keep_repairs: bool = False) -> None:
        self._remove_checks()  # what a check put in place for one forward (the observer) goes back first
        super().stop(keep_repairs)
        self.faithful_undo = None
        self.faithful_before = None
        self.parity = None
        self.replay = None
        self.audit_pending = False

    def finish(self, why_unchecked: str) -> None:
        """The run is over: say what was repeated and why its first step went unchecked if it did; remove it all."""
        if self.first_step_pending and not self.stopped:
            report.note(f"the first-step checks did not run: {why_unchecked}.", "info", self.is_main())
        for key, times in self.reported.items():  # routine: said once, in words, at DEBUG
            if times > 1:
                report.note(_repeated(key, times, self.mode), "debug", self.is_main())
        self.stop()

    def fail(self, exc: Exception, where: str) -> None:
        """A plugin bug in `where`: said; training goes on without the run's hooks."""
        report.note(internal_error(where, exc), "warning")
        self.stop()


def _unfaithful(model: weakref.ref[Any], before: Mapping[Any, tuple[Any, Any]]) -> None:
    if (alive := model()) is not None:
        ckpt.unfaithful_blocks(alive, before)


def _repeated(key: str, times: int, mode: str) -> str:
    """What the run met `times` times during training (`Record.count`), in words; only the first was a decision."""
    done = "left as they were (warn mode)" if mode == "warn" else "removed"
    if key == "hooks":
        return (
            f"checkpointing was re-enabled during training and added a duplicate input-require-grad hook {times} "
            f"times (TRL's DPO, KTO, GRPO and RLOO trainers re-enable it every step); the duplicates were {done}."
        )
    if key.startswith("drift:"):
        done = "reported" if mode == "warn" else "restored"
        return f"{key.partition(':')[2]} drifted from the decision {times} times during training; {done} each time."
    what = {
        "frozen-inputs": "a reentrant checkpointed block ran with inputs that do not require grad",
        "keyword-inputs": "a reentrant checkpointed block got a keyword input that requires grad",
    }.get(key, key)
    return f"{what}: {times} times during training (the first one is in the decisions)."


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


def _launcher_default_to_withdraw(args: Any, model: Any) -> bool:
    """A launcher (LLaMA-Factory) checkpoints through its own function and its own enable: the plugin's post-init
    default goes, so the launcher's `use_reentrant` is in force, as `trl-gc-check` reads it."""
    record = probe.get_record(args)
    if record is None or record.value_source != "plugin" or record.user_given or model is None:
        return False
    # the launcher must have replaced the enable: the Trainer's re-enable skips it otherwise
    return _launcher_checkpoints(model) and "gradient_checkpointing_enable" in vars(ckpt.unwrap(model))


def _key(d: Decision) -> tuple[Any, ...]:
    return (d.rule_id, d.action, d.setting, repr(d.before), repr(d.after))


def _launcher_checkpoints(model: Any) -> bool:
    """A launcher's own checkpoint function runs (LLaMA-Factory's): checkpointing is asked for."""
    return any(ckpt.wrapped(f) for _, f in ckpt.functions(ckpt.unwrap(model)))
