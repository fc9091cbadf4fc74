"""`SafeGCCallback`: decides, fixes and verifies gradient checkpointing for one Trainer."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from transformers import TrainerCallback

from . import _hooks, ckpt, parity, probe, report, settings, tracker, verify
from ._weak import WeakIdMap
from .apply import CacheSwitch, apply, set_args_use_reentrant, set_model_use_reentrant
from .decisions import Action, Decision, Level, first_sentence, write_decisions
from .engine import decide, final_use_reentrant
from .errors import GCConfigError
from .facts import Facts
from .keep import EnableGuard, every_n_pattern
from .modes import Mode
from .observe import Call, Observation, Verdict
from .patching import raise_for_errors
from .policy import action_for, refused
from .rules import RULES, get_rule

_VERDICT: dict[str, Verdict] = {"warn": "report", "error": "raise"}
"""The first-forward verdict for an action (`repair` / `override`: repair)."""

_STAND_BACK = frozenset(r.id for r in RULES if r.stand_back)

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
        self._decisions: list[Decision] = []
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
        return self._owner.decisions if self._owner is not None else self._decisions

    @decisions.setter
    def decisions(self, value: list[Decision]) -> None:
        self._decisions = value

    def _reset_run(self) -> None:
        self._final: tuple[Any, str] = (None, "unset")
        self._watch: verify.Watch | None = None
        self._observation: Observation | None = None
        self._cache: CacheSwitch | None = None
        self._cache_off = False
        self._every_n: int | None = None
        self._guard: EnableGuard | None = None
        self._plan_hook: Any = None
        self._forward_watch: list[Any] = []
        self._audit_pending = False
        self._parity_pending = False
        self._first_inputs: parity.FirstInputs | None = None
        self._reported: dict[str, int] = {}
        self._args: Any = None
        self._model: Any = None
        self._json_path: str | None = None
        self.observed: dict[str, Call] = {}
        self.plan_check: Any = None
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
        report.follow_trainer(args)
        tracker.move_before_reporters(self)  # a callback passed to the Trainer comes after the reporters
        if model is None:
            return
        facts = probe.facts_from_trainer(args, model, stage="init_end")
        decisions = decide(facts, self.mode)
        record = probe.get_record(args)
        self.decisions = (list(record.decisions) if record is not None else []) + decisions
        self._refuse(args, decisions)
        apply(decisions, args, model)
        self._cache_off = any(d.applied and d.setting == "model.config.use_cache" for d in decisions)
        if any(d.applied and d.setting == "checkpointing_kwargs" for d in decisions):
            self._every_n = facts.every_n_layers  # transformers < 5.23: the plugin applies it itself
        self._final = final_use_reentrant(decisions, facts.use_reentrant, facts.use_reentrant_source)
        probe.remember(args, *self._final)
        self._publish(args, decisions)
        if report.is_main_process(args):
            report.logger.info(
                report.summary_line(self.decisions, self.mode, self._final[0], self._final[1], self._json_path)
            )

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
        logs.update(tracker.summary(self.decisions, self._final[0], self._final[1], self.mode, self.plan_check, text))

    @_guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Checkpointing is live now: check the model runs what was decided; repair it when it does not."""
        if not self._active or model is None:
            return
        self._args, self._model = args, model
        facts = probe.facts_from_trainer(args, model, stage="train")
        seen = {(d.rule_id, d.action, d.setting, repr(d.before), repr(d.after)) for d in self.decisions}
        decisions = [
            d
            for d in decide(facts, self.mode)
            if d.action != "none" and (d.rule_id, d.action, d.setting, repr(d.before), repr(d.after)) not in seen
        ]
        if decisions:
            self.decisions.extend(decisions)
            self._refuse(args, decisions)
            apply(decisions, args, model)
            self._final = final_use_reentrant(decisions, *self._final)
            probe.remember(args, *self._final)
            self._publish(args, decisions)
        if self._cache_off:  # the configs as the Trainer leaves them (transformers 5 writes args.use_cache itself)
            self._cache = CacheSwitch(model)
        self._keep_what_was_enabled(facts, model)
        if self.memory_budget is not None and probe.checkpointing_on(model) and not self._stands_back():
            self._plan_when_the_shape_is_known(args, model)
        value = self._final[0]
        if not isinstance(value, bool):  # warn mode or a stand-back left it unset: watch what actually runs
            value = probe.model_use_reentrant(model)
        if isinstance(value, bool):
            self._watch = verify.Watch(args, model, value)
        self._asked_vs_running(args, model)
        if facts.reduces_per_parameter and probe.model_use_reentrant(model):
            self._watch_forwards_before_backward(args, model)
        if probe.checkpointing_on(model):  # the runtime checks run even when the plugin stands back from deciding
            self._observation = Observation(model, self._on_frozen_inputs, self._on_keyword_inputs)
            self._observation.install()
            self._audit_pending = self.audit
            self._parity_pending = self._wants_parity(args, model)
            if self._parity_pending:
                self._first_inputs = parity.FirstInputs(model)
                self._first_inputs.install()

    @_guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._cache is not None:
            self._cache.off()

    @_guarded
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not (self._audit_pending or self._parity_pending) or model is None:
            return
        if self._audit_pending:
            self._audit_pending = False
            self._audit(args, model)
        if self._parity_pending:
            self._parity_pending = False
            self._parity(args, model)

    @_guarded
    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._cache is not None:
            self._cache.restore()  # a checkpoint saved after this step keeps the user's config
        self._stop_forward_watch()  # the first step is over
        self._drop_first_inputs()
        if self._observation is not None:  # the first step is over: nothing of the observation stays
            self._observation.remove()
            self.observed = dict(self._observation.calls)
            if self._asked(args) and not self.observed and self._observation.eval_forwards:
                self._not_running(args, "the first training step's forwards ran in eval mode, so no block checkpointed")
            self._observation = None
        watch = self._watch
        if watch is None:
            return
        drifted = watch.drift() + (self._guard.drifted() if self._guard is not None else [])
        if drifted:
            self._repair_drift(args, model, drifted)
        if watch.embeddings is not None and watch.input_hooks() > 1:
            self._dedupe_hooks(args, watch)

    @_guarded
    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self._active:
            return
        self._stop_watching()
        repeats = {k: n for k, n in self._reported.items() if n > 1}
        if repeats:
            report.note(
                f"repeated during training (first occurrence logged above): {repeats}",
                "info",
                report.is_main_process(args),
            )

    # --- the first forward ---------------------------------------------------------------------------------------

    def _explicit(self) -> tuple[bool, str]:
        """Whether the running `use_reentrant=True` is the user's own choice (or of unknown origin), and its source."""
        value, source = self._final
        return value is True and source in ("user", "unknown"), source

    def _on_frozen_inputs(self, call: Call) -> Verdict:
        """A block ran reentrant with trainable parameters and inputs that do not require grad (observe.py)."""
        rule = get_rule("frozen-inputs-observed")
        explicit, source = self._explicit()
        action = action_for(self.mode, explicit=explicit, stands_back=self._stands_back())
        if action == "warn" and self._count("frozen-inputs") > 1:  # said once; the audit lists every block
            return "report"
        verdict: Verdict = _VERDICT.get(action, "repair")
        what = {
            "raise": "refused before the backward",
            "repair": "this call's input made to require grad; use_reentrant=False from now on",
            "report": "nothing changed: its parameters get no gradient",
        }[verdict]
        reason = (
            f"{call.module} ran with use_reentrant=True (set by {source}), holds trainable parameters, and none of its "
            f"inputs requires grad: reentrant checkpointing gives it no gradient; {what}. " + rule.message
        )
        return self._observed(rule, action, verdict, reason)

    def _on_keyword_inputs(self, call: Call, shared_with: str | None) -> Verdict:
        """A reentrant block got a tensor that requires grad as a keyword argument (observe.py). Certain failure once
        a second block gets the same tensor: both backpropagate into its graph from inside their own backward."""
        rule = get_rule("reentrant-keyword-inputs")
        explicit, source = self._explicit()
        names = ", ".join(call.keyword_inputs)
        action = action_for(self.mode, explicit=explicit, stands_back=self._stands_back())
        verdict: Verdict = _VERDICT.get(action, "repair")
        if shared_with is None:  # not certain yet
            if action in ("warn", "error"):  # reported or refused once certain
                return "keep"
            if action == "override":  # fix mode: this call runs non-reentrant (exact) until the evidence is in
                return "exact"
            evidence = f"{call.module} gets {names} as keyword argument(s) that require grad"  # repaired now
        else:
            evidence = f"{call.module} and {shared_with} get the same tensor ({names}) as a keyword argument"
        reason = (
            f"{evidence} under use_reentrant=True (set by {source}): reentrant checkpointing does not see keyword "
            "inputs and backpropagates into their graph from inside its own backward, so the second block fails with "
            "'Trying to backward through the graph a second time'. " + rule.message
        )
        if self._count("keyword-inputs") > 1:
            return verdict if verdict != "raise" else "keep"
        return self._observed(rule, action, verdict, reason)

    def _observed(self, rule: Any, action: Action, verdict: Verdict, reason: str) -> Verdict:
        """Record a first-forward finding; raise for a refusal, switch to non-reentrant for a repair."""
        decision = self._verdict(rule, action, True, verdict != "repair", reason)
        self._record(self._args, [decision])
        if verdict == "raise":
            self._stop_watching()
            self._raise_for_errors([decision], self.mode)
        if verdict == "repair":
            self._switch(self._args, self._model, False)
        return verdict

    def _count(self, key: str) -> int:
        self._reported[key] = self._reported.get(key, 0) + 1
        return self._reported[key]

    # --- verification --------------------------------------------------------------------------------------------

    def _audit(self, args: Any, model: Any) -> None:
        rule = get_rule("gradient-audit")
        sharded = verify.gradients_are_sharded(args, model)
        if sharded:
            self._record(args, [self._verdict(rule, "none", None, None, f"Skipped: {sharded}.")])
            return
        result = verify.audit_gradients(model, self._observation)
        value = self._watch.value if self._watch is not None else None
        verdicts: list[Decision] = []
        if result.ok and result.checked == 0:
            reason = (
                "No checkpointed block with trainable parameters was found to audit: the model checkpoints outside "
                "transformers' convention (`GradientCheckpointingLayer`, `_gradient_checkpointing_func`), e.g. by "
                "calling torch.utils.checkpoint itself; not covered by the audit."
            )
            verdicts.append(self._verdict(rule, "none", 0, 0, reason, level="info"))
        elif result.ok:
            reason = f"{result.checked} checkpointed block(s) with trainable parameters all received gradients."
            verdicts.append(self._verdict(rule, "none", result.checked, result.checked, reason))
        if result.broken:
            names = _names(result.broken)
            reason = (
                f"{len(result.broken)} of {result.checked} checkpointed block(s) with trainable parameters got no "
                f"gradient at the first optimizer step ({names}): the first forward saw them run reentrant "
                f"(use_reentrant={value!r}) with inputs that do not require grad. "
                + rule.message
                + " Switch the audit off with SafeGCCallback(audit=False) "
                "or TRL_GC_PLUGIN_AUDIT=0."
            )
            action: Action = refused(self.mode)
            if action == "override" and value is not True:
                action = "warn"  # nothing the plugin can switch: report it
            verdicts.append(self._verdict(rule, action, value, False if action == "override" else value, reason))
        if result.unused:
            verdicts.append(
                self._verdict(
                    rule,
                    "none",
                    len(result.unused),
                    len(result.unused),
                    f"{len(result.unused)} trainable checkpointed block(s) got no gradient because the loss does not "
                    f"use them ({_names(result.unused)}); checkpointing is not the cause (they ran with inputs that "
                    "require grad, or non-reentrant, or not at all). They will not train, with or without "
                    "checkpointing.",
                    level="info",
                )
            )
        if result.unverified:
            verdicts.append(
                self._verdict(
                    rule,
                    "warn",
                    None,
                    None,
                    f"{len(result.unverified)} checkpointed block(s) with trainable parameters got no gradient and the "
                    f"first forward was not observed for them ({_names(result.unverified)}), so the cause is unknown; "
                    "not refused. Run once with SafeGCCallback(parity_check=True) to compare with no checkpointing.",
                )
            )
        if result.nonfinite_params:
            verdicts.append(
                self._verdict(
                    rule,
                    "warn",
                    None,
                    None,
                    f"Non-finite gradients in {len(result.nonfinite_params)} parameter(s), e.g. "
                    f"{result.nonfinite_params[0]}.",
                )
            )
        self._record(args, verdicts)
        if any(v.action == "override" for v in verdicts):
            self._switch(args, model, False)
        self._raise_for_errors(verdicts, self.mode)

    def _repair_drift(self, args: Any, model: Any, drifted: list[tuple[str, Any]]) -> None:
        assert self._watch is not None
        rule, value = get_rule("checkpointing-drift"), self._watch.value
        report_only = action_for(self.mode, "repair", stands_back=self._stands_back()) == "warn"
        verdicts = []
        for setting, found in drifted:
            count = self._reported.get(f"drift:{setting}", 0) + 1
            self._reported[f"drift:{setting}"] = count
            if count > 1:
                continue
            if setting in ("layer_pattern", "checkpoint_function") and self._guard is not None:
                expected: Any = self._guard.pattern if setting == "layer_pattern" else "as enabled at train begin"
                reason = f"{setting} drifted to {found!r} mid-training; restored to {expected!r}."
            else:
                expected, reason = value, f"{setting} drifted to {found!r} mid-training; decided {value!r}."
            verdicts.append(
                self._verdict(rule, "warn" if report_only else "repair", found, expected, reason, setting=setting)
            )
        if not report_only:
            self._switch(args, model, value)
            if self._guard is not None:
                self._guard.reapply()
        self._record(args, verdicts)

    def _dedupe_hooks(self, args: Any, watch: verify.Watch) -> None:
        rule = get_rule("input-hook-pileup")
        before = watch.input_hooks()
        count = self._reported.get("hooks", 0) + 1
        self._reported["hooks"] = count
        action = action_for(self.mode, "repair")
        if action == "repair":
            watch.dedupe_input_hooks()
        if count == 1:
            self._record(
                args,
                [
                    self._verdict(
                        rule,
                        action,
                        before,
                        watch.input_hooks(),
                        f"{before} input-require-grad hooks on the input embeddings; kept one.",
                        level="info",
                    )
                ],
            )

    def _wants_parity(self, args: Any, model: Any) -> bool:
        """`parity_check=None`: on for reentrant runs in one process without sharding, for any model."""
        if self.parity_check is not None:
            return self.parity_check
        running = probe.model_use_reentrant(model)
        return bool(running and report_world_size(args) == 1 and not verify.gradients_are_sharded(args, model))

    def _drop_first_inputs(self) -> None:
        if self._first_inputs is not None:  # the probe ran at the step's optimizer step, or never will
            self._first_inputs.remove()
            self._first_inputs = None

    def _parity(self, args: Any, model: Any) -> None:
        rule = get_rule("parity-check")
        first, self._first_inputs = self._first_inputs, None
        if first is not None:
            first.remove()
        if verify.gradients_are_sharded(args, model):
            self._record(args, [self._verdict(rule, "none", None, None, "Skipped: sharded parameters.")])
            return
        inputs, batch = (first.inputs, first.batch) if first is not None else (None, None)
        target = probe.unwrap(model) if first is not None and first.for_base else model
        result = parity.parity_probe(target, inputs, batch)
        if result.skipped:
            reason = f"Skipped: {result.skipped}."
            self._record(args, [self._verdict(rule, "none", None, None, reason, level="info")])
            return
        summary = (
            f"{result.compared} trainable parameters compared on the {result.batch}: max difference "
            f"{result.max_abs:.3g}, max relative {result.max_rel:.3g} (tolerance {result.rtol:g} of each gradient)"
        )
        if result.missing_with_checkpointing:
            summary += (
                f"; {len(result.missing_with_checkpointing)} get a gradient only without checkpointing, e.g. "
                f"{result.missing_with_checkpointing[0]}"
            )
        if result.outside:
            summary += f"; {len(result.outside)} differ beyond it, most {result.outside[0]}"
        action: Action = (
            "none"
            if result.ok
            else ("error" if result.missing_with_checkpointing and self.mode == "strict" else "warn")
        )
        verdict = self._verdict(
            rule,
            action,
            None,
            {"max_abs": result.max_abs, "max_rel": result.max_rel, "compared": result.compared},
            summary + ".",
        )
        self._record(args, [verdict])
        self._raise_for_errors([verdict], self.mode)

    def _switch(self, args: Any, model: Any, value: bool) -> None:
        set_args_use_reentrant(args, value)
        if model is not None:
            set_model_use_reentrant(model, value)
        if self._watch is not None:
            self._watch.value = self._watch.args_value = value
        self._final = (value, "plugin")
        probe.remember(args, *self._final)

    @staticmethod
    def _asked(args: Any) -> bool:
        return bool(getattr(args, probe.flag_field(args), False))

    def _asked_vs_running(self, args: Any, model: Any) -> None:
        """Checkpointing asked for but not running (memory), or running without being asked for (speed)."""
        asked, running = self._asked(args), probe.checkpointing_on(model)
        if asked and not running:
            self._not_running(args, "no block has checkpointing switched on at train begin")
        elif running and not asked and not self._launcher_checkpoints(model):
            rule = get_rule("checkpointing-unasked")
            blocks = sum(probe.block_pattern(model))
            reason = (
                f"{blocks} block(s) checkpoint although the arguments say activation_checkpointing=False. "
                + rule.message
            )
            self._record(args, [self._verdict(rule, "warn", False, True, reason, level="info")])

    @staticmethod
    def _launcher_checkpoints(model: Any) -> bool:
        """A launcher's own checkpoint function runs (`ckpt.wrapped`): it enabled checkpointing on purpose (LLaMA-Factory
        does on the model, by default, with the Trainer's flag false), so it is asked for, by the launcher."""
        return any(ckpt.wrapped(f) for _, f in ckpt.functions(probe.unwrap(model)))

    def _not_running(self, args: Any, why: str) -> None:
        rule = get_rule("checkpointing-not-running")
        self._record(
            args, [self._verdict(rule, "warn", True, False, f"Checkpointing is asked for but {why}. " + rule.message)]
        )

    def _keep_what_was_enabled(self, facts: Facts, model: Any) -> None:
        """Apply `every_n_layers` where transformers cannot (before 5.16), and keep the layer pattern, the offload
        wrapper and the plugin's keywords across re-enables (TRL's DPO/GRPO/KTO/RLOO re-enable with the raw kwargs
        every step)."""
        if self._stands_back() or not probe.checkpointing_on(model):
            return
        layer_kwargs = probe.reads_layer_kwargs(facts.caps)
        every_n = None if "every_n_layers" in layer_kwargs else self._every_n
        if every_n:
            blocks = ckpt.blocks(probe.unwrap(model))
            ckpt.apply(model, ckpt.Spec(pattern=every_n_pattern(len(blocks), every_n)))
        if every_n or (layer_kwargs and (facts.every_n_layers or facts.offload)):
            self._guard = EnableGuard(model, layer_kwargs)
            self._guard.install()

    def _watch_forwards_before_backward(self, args: Any, model: Any) -> None:
        """For the first step: a second grad-enabled forward before the first backward, under a wrapper that reduces
        each parameter's gradient as soon as it is computed (ZeRO-1 with overlap_comm, ZeRO-2/3, DDP)."""
        base = probe.unwrap(model)
        state = {"pending": False}

        def before(module: Any, f_args: Any) -> None:
            import torch

            if not (module.training and torch.is_grad_enabled()):
                return
            if state["pending"]:
                self._stop_forward_watch()
                self._second_forward(args)
            state["pending"] = True

        def after(module: Any, f_args: Any, output: Any) -> None:
            tensor = _grad_output(output)
            if tensor is None:
                state["pending"] = False
                return
            tensor.register_hook(lambda grad: state.update(pending=False))

        self._forward_watch = [_hooks.on_forward_pre(base, before), _hooks.on_forward(base, after)]

    def _second_forward(self, args: Any) -> None:
        rule = get_rule("two-forwards-before-backward")
        action = action_for(self.mode, explicit=True, stands_back=self._stands_back(), can_fix=False)
        reason = (
            "A second grad-enabled forward of the model ran before the first backward, with reentrant checkpointing, "
            "under a wrapper that reduces each parameter's gradient once per backward. " + rule.message
        )
        decision = self._verdict(rule, action, True, False, reason)
        self._record(args, [decision])
        if action == "error":
            self._raise_for_errors([decision], "strict")  # nothing to switch: fix mode refuses as strict does

    def _stop_forward_watch(self) -> None:
        for handle in self._forward_watch:
            handle.remove()
        self._forward_watch = []

    # --- the memory plan ---------------------------------------------------------------------------------------

    def _plan_when_the_shape_is_known(self, args: Any, model: Any) -> None:
        """Plan at the first training forward (a one-shot pre-hook, gone after it ran), from the batch it really runs
        (DPO's chosen and rejected rows, GRPO's completions, packed rows) and the non-tensor keywords it is called
        with (TRL's fused LM head); the sequence length is the longest the arguments allow (`max_length`), so a later,
        longer batch fits too. That forward is then measured and checked against the prediction (`_check_plan`).
        Without a readable input shape, the arguments' `per_device_train_batch_size` x `max_length` is planned."""
        base = probe.unwrap(model)

        def first_forward(module: Any, f_args: tuple[Any, ...], f_kwargs: dict[str, Any]) -> None:
            import torch

            if not (module.training and torch.is_grad_enabled()):
                return
            self._remove_plan_hook()
            shape = _input_shape(f_args, f_kwargs)
            try:
                if shape is None:
                    seq = planned_sequence_length(args)
                    batch = int(getattr(args, "per_device_train_batch_size", 0) or 0)
                    if not (seq and batch):
                        self._record(args, [self._plan_skipped("the first forward's input shape could not be read")])
                        return
                    self._plan(args, model, batch, seq)
                    return
                keywords = _call_keywords(f_kwargs)
                planned = self._plan(args, model, *planned_shape(args, shape), forward_kwargs=keywords)
                if planned is not None:
                    self._start_plan_check(args, model, base, planned, shape, keywords)
            except GCConfigError:
                raise
            except Exception as exc:  # a plugin bug never stops training
                self._record(args, [self._plan_skipped(f"{type(exc).__name__}: {exc}")])

        # outside the module where torch allows it (a copy of the model made before the first forward carries
        # nothing of the plugin); else a module hook, gone after the first training forward
        handle = _hooks.on_forward_pre_with_kwargs(base, first_forward)
        if handle is None:
            handle = base.register_forward_pre_hook(first_forward, with_kwargs=True, prepend=True)
        self._plan_hook = handle

    def _remove_plan_hook(self) -> None:
        if self._plan_hook is not None:
            self._plan_hook.remove()
            self._plan_hook = None

    def _plan(self, args: Any, model: Any, batch: int, seq: int, forward_kwargs: dict[str, Any] | None = None) -> Any:
        """Estimate, plan and apply; returns the `(estimate, plan)` the plan was made from, None when skipped."""
        from . import memory, planner

        sharded = verify.gradients_are_sharded(args, model)
        if sharded:
            self._record(args, [self._plan_skipped(f"not planned under sharding ({sharded})")])
            return None
        use_reentrant = probe.model_use_reentrant(model)
        try:
            budget = budget_bytes(self.memory_budget, model)
            estimate = memory.estimate(model, batch, seq, forward_kwargs=forward_kwargs)
            plan = planner.plan(
                estimate, budget, allow_selective=use_reentrant is False, allow_offload=probe.accelerator_available()
            )
            decisions = planner.plan_decisions(plan, self.mode)
        except GCConfigError:
            raise
        except Exception as exc:  # a model the estimate cannot run: checkpointing stays as asked
            self._record(args, [self._plan_skipped(f"the estimate failed ({type(exc).__name__}: {exc})")])
            return None
        if not self._apply_plan(args, model, plan, decisions, use_reentrant):
            return None
        return estimate, plan

    def _apply_plan(self, args: Any, model: Any, plan: Any, decisions: list[Decision], use_reentrant: Any) -> bool:
        """Record the plan's decisions and apply the chosen candidate (not in warn mode); False when it could not
        be applied."""
        from . import planner

        if self.mode == "warn":  # warn mode changes nothing: say what would run
            decisions = [dataclasses.replace(d, action="warn", applied=False) for d in decisions]
        self._record(args, decisions)
        self._raise_for_errors(decisions, self.mode)
        chosen = plan.chosen or plan.lowest
        if self.mode != "warn" and chosen is not None:
            try:
                planner.apply_plan(model, chosen, bool(use_reentrant))
            except ValueError as exc:  # e.g. blocks the estimate did not count: checkpointing stays as asked
                self._record(args, [self._plan_skipped(f"it could not be applied ({exc})")])
                return False
            if self._guard is None:
                self._guard = EnableGuard(model, probe.reads_layer_kwargs(probe.capabilities.installed()))
                self._guard.install()
            self._guard.record()
        report.note(
            f"memory plan: {first_sentence(decisions[0].reason)}",
            decisions[0].level,
            report.is_main_process(args),
        )
        return True

    def _start_plan_check(
        self,
        args: Any,
        model: Any,
        base: Any,
        planned: tuple[Any, Any],
        shape: tuple[int, int],
        keywords: dict[str, Any],
    ) -> None:
        """Measure the forward that is starting (`memory.meter`: bytes autograd saves, per block) and, when it ends,
        compare them with the prediction for its own batch shape (a one-shot post-hook, gone after it ran)."""
        from . import memory

        metering = memory.meter(model)
        measured = metering.__enter__()

        def finish() -> None:
            hook.remove()
            self._plan_hook = None
            metering.__exit__(None, None, None)

        def after(module: Any, f_args: Any, output: Any) -> None:
            finish()
            if output is None:  # the forward raised: nothing to compare
                return
            try:
                self._check_plan(args, model, planned, measured, shape, keywords)
            except GCConfigError:
                raise
            except Exception as exc:  # a plugin bug never stops training
                self._record(args, [self._plan_skipped(f"the check failed ({type(exc).__name__}: {exc})")])

        hook = _hooks.on_forward(base, after)
        self._plan_hook = _Once(finish)

    def _check_plan(
        self,
        args: Any,
        model: Any,
        planned: tuple[Any, Any],
        measured: Any,
        shape: tuple[int, int],
        keywords: dict[str, Any],
    ) -> None:
        """Report a plan whose prediction misses the first step's measurement by more than 15%; fix mode re-plans
        from the measurement. An accurate plan says nothing. The prediction for the forward's own shape is the
        plan's estimate scaled to its tokens when the plan was made for a longer batch, and a miss is confirmed
        with an estimate at that shape (paid only then)."""
        from . import memory, plan_check, planner

        estimate, plan = planned
        same = (estimate.batch_size, estimate.seq_len) == shape
        comparison = plan_check.compare(estimate if same else plan_check.scaled(estimate, *shape), measured, model)
        if comparison is not None and comparison.off and not same:
            comparison = plan_check.compare(memory.estimate(model, *shape, forward_kwargs=keywords), measured, model)
        self.plan_check = comparison
        if comparison is None or not comparison.off:
            return
        rows, tokens = comparison.batch_shape
        replan = None
        if self.mode == "fix":
            fixed = plan_check.corrected(estimate, comparison)
            replan = planner.plan(
                fixed,
                plan.budget,
                allow_selective=probe.model_use_reentrant(model) is False,
                allow_offload=probe.accelerator_available(),
            )
        after = {
            **comparison.to_dict(),
            "planned_shape": [estimate.batch_size, estimate.seq_len],
            "plan": (plan.chosen or plan.lowest).name,
            "replanned": (replan.chosen or replan.lowest).name if replan is not None else None,
        }
        reason = (
            f"The memory plan's prediction misses the first training step: it saved "
            f"{planner.format_bytes(comparison.measured)} for the backward ({comparison.measured} bytes) where "
            f"{planner.format_bytes(comparison.predicted)} ({comparison.predicted} bytes) were predicted for its "
            f"{rows} x {tokens} batch (x{comparison.ratio:.2f}; blocks {comparison.blocks_measured} vs "
            f"{comparison.blocks_predicted} bytes, outside them {comparison.outside_measured} vs "
            f"{comparison.outside_predicted}). Something the estimate does not run changes what is saved (a forward "
            "wrapper, a hook, another batch shape); "
            + (
                "re-planned from the measurement (fix mode)."
                if replan is not None
                else "the plan stands; fix mode re-plans from the measurement."
            )
        )
        rule = get_rule("memory-plan")
        decision = self._verdict(rule, "warn", "prediction", "measurement", reason, setting="memory_plan_check")
        self._record(args, [dataclasses.replace(decision, before=comparison.predicted, after=after)])
        if replan is not None:
            decisions = planner.plan_decisions(replan, self.mode)
            self._apply_plan(args, model, replan, decisions, probe.model_use_reentrant(model))

    def _plan_skipped(self, why: str) -> Decision:
        rule = get_rule("memory-plan")
        return self._verdict(
            rule, "warn", None, None, f"No memory plan: {why}; checkpointing runs as asked.", level="warning"
        )

    def _stands_back(self) -> bool:
        """Another library or the model's own code owns checkpointing (a `stand_back` rule applied): the plugin
        decides nothing and only reports what its checks see."""
        return any(d.rule_id in _STAND_BACK for d in self.decisions)

    def _raise_for_errors(self, decisions: list[Decision], mode: str) -> None:
        """Raise `GCConfigError` for the `error` decisions (`raise_for_errors`), after removing every trace of the run
        from the model: a refused run never reaches `on_train_end`, and a hook left waiting would keep the model
        alive in the process-wide hook table."""
        try:
            raise_for_errors(decisions, mode)
        except GCConfigError:
            self._stop_watching()
            raise

    def _stop_watching(self) -> None:
        """Remove every trace of the run from the model (observation hooks, the enable guard) and its config
        (use_cache)."""
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if self._plan_hook is not None:
            self._plan_hook.remove()
            self._plan_hook = None
        self._stop_forward_watch()
        if self._first_inputs is not None:
            self._first_inputs.remove()
            self._first_inputs = None
        if self._observation is not None:
            self._observation.remove()
            self._observation = None
        if self._cache is not None:
            self._cache.restore()
            self._cache = None
        self._watch = None

    # --- helpers -----------------------------------------------------------------------------------------------

    @staticmethod
    def _verdict(
        rule: Any,
        action: Action,
        before: Any,
        after: Any,
        reason: str,
        setting: str | None = None,
        level: Level | None = None,
    ) -> Decision:
        return Decision.from_rule(rule, action, before, after, "runtime", reason, "train", setting, level)

    def _record(self, args: Any, new: list[Decision]) -> None:
        if not new:
            return
        self.decisions.extend(new)
        self._publish(args, new)

    def _publish(self, args: Any, new: list[Decision]) -> None:
        """Log the new decisions (main process) and rewrite `gc_decisions.json` when checkpointing is involved."""
        main = report.is_main_process(args)
        report.log_decisions(new, main)
        worth_a_file = any(d.rule_id != "checkpointing-off" for d in self.decisions)
        if main and self.write_json and worth_a_file:
            self._json_path = write_decisions(self.decisions, getattr(args, "output_dir", None)) or self._json_path

    def _refuse(self, args: Any, decisions: list[Decision]) -> None:
        """Before anything is applied: in strict/fix mode, log and raise for `error` decisions."""
        if self.mode != "warn" and any(d.action == "error" for d in decisions):
            self._publish(args, decisions)
            self._raise_for_errors(decisions, self.mode)

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
        self._watch = None
        self._owner = owner
        if owner.mode != self.mode:
            report.note(
                f"SafeGCCallback is registered twice for this Trainer: the one passed to the Trainer acts "
                f"(mode={owner.mode}); the one from install()/TRL_GC_PLUGIN (mode={self.mode}) stands by.",
                "warning",
            )


SEQUENCE_FIELDS = ("max_length", "max_seq_length")


def budget_bytes(budget: str | int, model: Any) -> int:
    """The budget in bytes; `auto`: free CUDA memory now, less an Adam optimizer state (8 bytes per trainable
    parameter), less 10% for the allocator."""
    if budget != "auto":
        return int(budget)
    import torch

    if not torch.cuda.is_available():
        raise GCConfigError('memory_budget="auto" reads the free CUDA memory; give a size ("40GiB") on this machine.')
    free, _ = torch.cuda.mem_get_info()
    optimizer = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(int((free - optimizer) * 0.9), 1)


def planned_sequence_length(args: Any) -> int | None:
    """The longest sequence the arguments allow (TRL's `max_length`, GRPO's prompt + completion), None if unknown."""
    for name in SEQUENCE_FIELDS:
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    prompt, completion = getattr(args, "max_prompt_length", None), getattr(args, "max_completion_length", None)
    if isinstance(prompt, int) and isinstance(completion, int) and prompt > 0 and completion > 0:
        return prompt + completion
    return None


def planned_shape(args: Any, shape: tuple[int, int]) -> tuple[int, int]:
    """The batch shape to plan for, from the first training forward's `shape` (rows x tokens): its rows (DPO's
    chosen and rejected, GRPO's completions), and the longest sequence the arguments allow (`max_length`) when it is
    longer; a padding-free or packed batch (one row, TRL's `padding_free`, `packing` with `bfd`) up to
    `per_device_train_batch_size` x `max_length` tokens."""
    rows, tokens = shape
    length = planned_sequence_length(args)
    if length is None:
        return shape
    packed = bool(getattr(args, "padding_free", False)) or (
        bool(getattr(args, "packing", False)) and str(getattr(args, "packing_strategy", "bfd")).startswith("bfd")
    )
    if rows == 1 and packed:
        per_device = int(getattr(args, "per_device_train_batch_size", 1) or 1)
        return 1, max(tokens, per_device * length)
    return rows, max(tokens, length)


def _call_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The non-tensor keyword arguments of a model call (`fused_lm_head=True`, `use_cache=False`, ...): what makes
    the estimate's fake forward take the same path."""
    import torch

    return {
        k: v
        for k, v in kwargs.items()
        if k not in ("input_ids", "labels", "inputs_embeds")
        and not isinstance(v, torch.Tensor)
        and (v is None or isinstance(v, bool | int | float | str))
    }


class _Once:
    """A handle whose `remove()` runs a cleanup once (the plan check's meter and hook)."""

    def __init__(self, cleanup: Callable[[], None]) -> None:
        self._cleanup: Callable[[], None] | None = cleanup

    def remove(self) -> None:
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup()


def _input_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    import torch

    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *(args[:1] or ())):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return None


def _grad_output(output: Any) -> Any:
    """A tensor of the model's output that requires grad (the loss, else the logits, else the first one)."""
    import torch

    candidates = [getattr(output, name, None) for name in ("loss", "logits")]
    if isinstance(output, (tuple, list)):
        candidates += list(output)
    elif isinstance(output, torch.Tensor):
        candidates.append(output)
    return next((t for t in candidates if isinstance(t, torch.Tensor) and t.requires_grad), None)


def report_world_size(args: Any) -> int:
    """Processes of the launch (the launcher's WORLD_SIZE, else the arguments')."""
    value = os.environ.get("WORLD_SIZE", "")
    if value.isdigit():
        return int(value)
    try:
        return int(getattr(args, "world_size", 1) or 1)
    except Exception:
        return 1


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")


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
