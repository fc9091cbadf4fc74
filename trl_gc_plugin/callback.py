"""`SafeGCCallback`: decides, fixes and verifies gradient checkpointing for one Trainer."""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback

from . import probe, verify
from ._flags import parse_flag
from .apply import apply, restore_use_cache, set_args_use_reentrant, set_model_use_reentrant
from .decisions import Action, Decision, is_main_process, log_decisions, write_decisions
from .engine import decide, final_use_reentrant, refused
from .modes import Mode, resolve_mode
from .patching import raise_for_errors
from .rules import get_rule

logger = logging.getLogger("trl_gc_plugin")

_CLAIM = "_trl_gc_plugin_owner"
AUDIT_ENV = "TRL_GC_PLUGIN_AUDIT"


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    flag = parse_flag(value) if value else None
    return default if flag is None else flag


class SafeGCCallback(TrainerCallback):
    """A [`~transformers.TrainerCallback`] that makes gradient checkpointing safe for the run it is attached to.

    At `on_init_end` it reads the arguments and the model, decides `use_reentrant` with the rule table
    (`trl_gc_plugin.RULES`), validates the combination, writes the decision into the arguments (both the
    `activation_checkpointing*` and the deprecated `gradient_checkpointing*` names, as one object) and into a
    model that already checkpoints, and logs every decision. Then it verifies the running training:

    - `on_train_begin` (checkpointing is live): the model runs what was decided, else it is repaired; with
      `parity_check=True`, gradients with and without checkpointing are compared once on a synthetic batch.
    - `on_pre_optimizer_step`, first step only (`audit=True`): every checkpointed block with trainable parameters
      received a gradient.
    - `on_step_end`, every step, a few attribute reads: the arguments and the model still hold the decision (DPO and
      GRPO re-enable checkpointing every step), and the embeddings carry one input-require-grad hook, not a pile.
    - `on_train_end`: restores what it changed on the model config.

    Args:
        mode (`str`, *optional*):
            `"strict"` (default): fill unset values, repair upstream inconsistencies, raise `GCConfigError` before
            the first optimizer step for an explicit choice known to break training (or a failed audit). `"fix"`: as
            strict, but override such a choice with a loud warning. `"warn"`: change nothing, log what strict/fix
            would do. `None` reads `TRL_GC_PLUGIN_MODE`.
        write_json (`bool`, *optional*, defaults to `True`):
            Write the decisions to `<output_dir>/gc_decisions.json` (main process only).
        audit (`bool`, *optional*):
            The first-step gradient audit; defaults to `TRL_GC_PLUGIN_AUDIT`, then on.
        parity_check (`bool`, *optional*, defaults to `False`):
            Compare gradients with and without checkpointing once at train begin (costs two extra forward/backward
            passes on a batch of one 16-token sequence).

    Environment:
        TRL_GC_PLUGIN_MODE: the mode when `mode` is None.
        TRL_GC_PLUGIN_AUDIT: `0` switches the gradient audit off when `audit` is None.

    Attributes:
        decisions (`list[Decision]`): the decisions for the last Trainer this callback saw, the ones taken when
            its arguments were built (with `install()`) first.

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
        parity_check: bool = False,
    ) -> None:
        self.mode: Mode = resolve_mode(mode)
        self.write_json = write_json
        self.audit = _env_flag(AUDIT_ENV, True) if audit is None else audit
        self.parity_check = parity_check
        self.decisions: list[Decision] = []
        self._active = False
        self._final: tuple[Any, str] = (None, "unset")
        self._watch: verify.Watch | None = None
        self._audit_pending = False
        self._reported: dict[str, int] = {}

    # --- events ------------------------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        owner = state.__dict__.get(_CLAIM)
        if owner is not None and owner is not self:
            self._become_passive(owner)
            return
        state.__dict__[_CLAIM] = self
        self._active = True
        self._watch, self._reported = None, {}
        if model is None:
            return
        facts = probe.facts_from_trainer(args, model, stage="init_end")
        decisions = decide(facts, self.mode)
        record = probe.get_record(args)
        self.decisions = (list(record.decisions) if record is not None else []) + decisions
        self._refuse(args, decisions)
        apply(decisions, args, model)
        self._final = final_use_reentrant(decisions, facts.use_reentrant, facts.use_reentrant_source)
        probe.remember(args, *self._final)
        self._publish(args, decisions)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Checkpointing is live now: check the model runs what was decided; repair it when it does not."""
        if not self._active or model is None:
            return
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
        value = self._final[0]
        if not isinstance(value, bool):  # warn mode left it unset: watch what actually runs
            value = probe.model_use_reentrant(model)
        if isinstance(value, bool):
            self._watch = verify.Watch(args, model, value)
            self._audit_pending = self.audit
            if self.parity_check:
                self._parity(args, model)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self._audit_pending or model is None:
            return
        self._audit_pending = False
        self._audit(args, model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        watch = self._watch
        if watch is None:
            return
        drifted = watch.drift()
        if drifted:
            self._repair_drift(args, model, drifted)
        if watch.embeddings is not None and watch.input_hooks() > 1:
            self._dedupe_hooks(args, watch)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self._active:
            return
        if model is not None and restore_use_cache(model):
            logger.debug("model.config.use_cache restored")
        repeats = {k: n for k, n in self._reported.items() if n > 1}
        if repeats and is_main_process(args):
            logger.warning("trl_gc_plugin: repeated during training (first occurrence logged above): %s", repeats)

    # --- verification --------------------------------------------------------------------------------------------

    def _audit(self, args: Any, model: Any) -> None:
        rule = get_rule("gradient-audit")
        sharded = verify.gradients_are_sharded(args)
        if sharded:
            self._record(args, [self._verdict(rule, "none", None, None, f"Skipped: {sharded}.")])
            return
        result = verify.audit_gradients(model)
        value = self._watch.value if self._watch is not None else None
        if result.ok:
            reason = f"{result.checked} checkpointed block(s) with trainable parameters all received gradients."
            verdicts = [self._verdict(rule, "none", result.checked, result.checked, reason)]
        else:
            blocks = ", ".join(result.dead_blocks[:6]) + (" ..." if len(result.dead_blocks) > 6 else "")
            reason = (
                f"{len(result.dead_blocks)} of {result.checked} checkpointed block(s) with trainable parameters got "
                f"no gradient at the first optimizer step ({blocks}; e.g. {result.dead_params[0]}); effective "
                f"use_reentrant={value!r}. " + rule.message + " Switch the audit off with SafeGCCallback(audit=False) "
                "or TRL_GC_PLUGIN_AUDIT=0."
            )
            action: Action = refused(self.mode)
            if action == "override" and value is not True:
                action = "warn"  # nothing the plugin can switch: report it
            verdicts = [self._verdict(rule, action, value, False if action == "override" else value, reason)]
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
        if verdicts[0].action == "override":
            self._switch(args, model, False)
        raise_for_errors(verdicts, self.mode)

    def _repair_drift(self, args: Any, model: Any, drifted: list[tuple[str, Any]]) -> None:
        assert self._watch is not None
        rule, value = get_rule("checkpointing-drift"), self._watch.value
        verdicts = []
        for setting, found in drifted:
            count = self._reported.get(f"drift:{setting}", 0) + 1
            self._reported[f"drift:{setting}"] = count
            action: Action = "warn" if self.mode == "warn" else "repair"
            if count == 1:
                verdicts.append(
                    self._verdict(
                        rule,
                        action,
                        found,
                        value,
                        f"{setting} drifted to {found!r} mid-training; decided {value!r}.",
                        setting=setting,
                    )
                )
        if self.mode != "warn":
            self._switch(args, model, value)
        self._record(args, verdicts)

    def _dedupe_hooks(self, args: Any, watch: verify.Watch) -> None:
        rule = get_rule("input-hook-pileup")
        before = watch.input_hooks()
        count = self._reported.get("hooks", 0) + 1
        self._reported["hooks"] = count
        if self.mode != "warn":
            watch.dedupe_input_hooks()
        if count == 1:
            action: Action = "warn" if self.mode == "warn" else "repair"
            self._record(
                args,
                [
                    self._verdict(
                        rule,
                        action,
                        before,
                        watch.input_hooks(),
                        f"{before} input-require-grad hooks on the input embeddings; kept one.",
                    )
                ],
            )

    def _parity(self, args: Any, model: Any) -> None:
        rule = get_rule("parity-check")
        if verify.gradients_are_sharded(args):
            self._record(args, [self._verdict(rule, "none", None, None, "Skipped: sharded parameters.")])
            return
        result, scale = verify.parity_probe(model)
        if result.skipped:
            self._record(args, [self._verdict(rule, "none", None, None, f"Skipped: {result.skipped}.")])
            return
        low_precision = any(p.dtype in _low_precision() for p in model.parameters() if p.requires_grad)
        rtol = 1e-2 if low_precision else verify.PARITY_RTOL
        ok = result.within(verify.PARITY_ATOL, rtol, scale)
        summary = (
            f"{result.compared} trainable parameters compared: max abs diff {result.max_abs:.3g}, max rel "
            f"diff {result.max_rel:.3g} (tolerance {verify.PARITY_ATOL:g} + {rtol:g} * {scale:.3g})"
        )
        if result.missing_with_checkpointing:
            summary += (
                f"; {len(result.missing_with_checkpointing)} get a gradient only without checkpointing, e.g. "
                f"{result.missing_with_checkpointing[0]}"
            )
        action: Action = (
            "none" if ok else ("error" if result.missing_with_checkpointing and self.mode == "strict" else "warn")
        )
        verdict = self._verdict(
            rule,
            action,
            None,
            {"max_abs": result.max_abs, "max_rel": result.max_rel, "compared": result.compared},
            summary + ".",
        )
        self._record(args, [verdict])
        raise_for_errors([verdict], self.mode)

    def _switch(self, args: Any, model: Any, value: bool) -> None:
        set_args_use_reentrant(args, value)
        if model is not None:
            set_model_use_reentrant(model, value)
        if self._watch is not None:
            self._watch.value = self._watch.args_value = value
        self._final = (value, "plugin")
        probe.remember(args, *self._final)

    # --- helpers -----------------------------------------------------------------------------------------------

    @staticmethod
    def _verdict(
        rule: Any, action: Action, before: Any, after: Any, reason: str, setting: str | None = None
    ) -> Decision:
        return Decision.from_rule(rule, action, before, after, "runtime", reason, "train", setting)

    def _record(self, args: Any, new: list[Decision]) -> None:
        if not new:
            return
        self.decisions.extend(new)
        self._publish(args, new)

    def _publish(self, args: Any, new: list[Decision]) -> None:
        main = is_main_process(args)
        log_decisions(new, main)
        if main and self.write_json:
            write_decisions(self.decisions, getattr(args, "output_dir", None))

    def _refuse(self, args: Any, decisions: list[Decision]) -> None:
        """Before anything is applied: in strict/fix mode, log and raise for `error` decisions."""
        if self.mode != "warn" and any(d.action == "error" for d in decisions):
            self._publish(args, decisions)
            raise_for_errors(decisions, self.mode)

    def _become_passive(self, owner: SafeGCCallback) -> None:
        """Registered twice (explicitly and through TRL_GC_PLUGIN / install()): the first instance acts."""
        self._active = False
        self._watch = None
        self.decisions = owner.decisions
        if owner.mode != self.mode:
            logger.warning(
                "SafeGCCallback is registered twice for this Trainer; the first one (mode=%s) acts, this one "
                "(mode=%s) stands by. Set TRL_GC_PLUGIN_MODE=%s, or drop one of the registrations.",
                owner.mode,
                self.mode,
                self.mode,
            )


def _low_precision() -> tuple[Any, ...]:
    import torch

    return (torch.float16, torch.bfloat16)


class AutoSafeGCCallback(SafeGCCallback):
    """The class `install()` and `TRL_GC_PLUGIN=1` put in `transformers.trainer.DEFAULT_CALLBACKS`."""

    auto_registered = True
