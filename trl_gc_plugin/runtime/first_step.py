"""The checks of the first optimizer step, before any parameter update: the gradient audit, DDP's unused parameters
and the parity probe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.decisions import Action, Decision
from ..core.modes import Mode
from ..core.policy import action_for, refused
from ..core.rules import get_rule
from ..model import ckpt, probe, verify
from . import parity
from .record import Record, names_of, runtime_decision


def gradients(run: Record, model: Any, observation: Any) -> verify.AuditResult | None:
    """None, recorded as skipped, where the gradients are sharded."""
    sharded = verify.gradients_are_sharded(run.args, model)
    if sharded:
        run.record([runtime_decision(get_rule("gradient-audit"), "none", None, None, f"Skipped: {sharded}.")])
        return None
    return verify.audit_gradients(model, observation)


def audit(run: Record, result: verify.AuditResult, probe_follows: bool) -> None:
    """Judge the first step's gradients per checkpointed block (`probe_follows`: the parity probe runs next)."""
    rule = get_rule("gradient-audit")
    value = run.reentrant.value
    verdicts: list[Decision] = []
    if result.ok and result.checked == 0:
        reason = (
            "No checkpointed block with trainable parameters was found to audit: the model checkpoints outside "
            "transformers' convention (`GradientCheckpointingLayer`, `_gradient_checkpointing_func`), e.g. by "
            "calling torch.utils.checkpoint itself; not covered by the audit."
        )
        verdicts.append(runtime_decision(rule, "none", 0, 0, reason, level="info"))
    elif result.ok:
        reason = f"{result.checked} checkpointed block(s) with trainable parameters all received gradients."
        verdicts.append(runtime_decision(rule, "none", result.checked, result.checked, reason))
    if result.broken:
        reason = (
            f"{len(result.broken)} of {result.checked} checkpointed block(s) with trainable parameters got no "
            f"gradient at the first optimizer step ({names_of(result.broken)}): the first forward saw them run "
            f"reentrant (use_reentrant={value!r}) with inputs that do not require grad. "
            + rule.message
            + " Switch the audit off with SafeGCCallback(audit=False) or TRL_GC_PLUGIN_AUDIT=0."
        )
        refusal = refused(run.mode) if value is True else _refused_or_said(run.mode)
        verdicts.append(runtime_decision(rule, refusal, value, False if refusal == "override" else value, reason))
    compare = (
        " The parity probe below compares them with no checkpointing."
        if probe_follows
        else " Run once with SafeGCCallback(parity_check=True) to compare with no checkpointing."
    )
    if result.unused:
        reason = (
            f"{len(result.unused)} trainable checkpointed block(s) got no gradient ({names_of(result.unused)}) "
            "although they ran with inputs that require grad, or non-reentrant, or not at all: not the frozen-inputs "
            "failure; the loss does not use them, or their recompute differs from their forward." + compare
        )
        verdicts.append(runtime_decision(rule, "none", len(result.unused), len(result.unused), reason, level="info"))
    if result.zero:
        reason = (
            f"{len(result.zero)} trainable checkpointed block(s) got a gradient of zeros only "
            f"({names_of(result.zero)}): the loss does not depend on them in this batch, or their recompute differs "
            "from their forward (a side input that a hook set for the forward and cleared before the backward)."
            + compare
        )
        action: Action = "none" if probe_follows else "warn"
        verdicts.append(runtime_decision(rule, action, None, None, reason, level="info" if probe_follows else None))
    if result.unverified:
        reason = (
            f"{len(result.unverified)} checkpointed block(s) with trainable parameters got no gradient and the first "
            f"forward was not observed for them ({names_of(result.unverified)}), so the cause is unknown; not refused."
            + compare
        )
        verdicts.append(runtime_decision(rule, "warn", None, None, reason))
    if result.nonfinite_params:
        reason = (
            f"Non-finite gradients in {len(result.nonfinite_params)} parameter(s), e.g. {result.nonfinite_params[0]}."
        )
        verdicts.append(runtime_decision(rule, "warn", None, None, reason))
    run.conclude(verdicts)
    if any(v.action == "override" for v in verdicts):
        run.switch(False)


def ddp_unused(run: Record, model: Any) -> None:
    """Trainable parameters without a gradient under DDP without `find_unused_parameters`: refused."""
    names = [n for n, p in ckpt.unwrap(model).named_parameters() if p.requires_grad and p.grad is None]
    if not names:
        return
    rule = get_rule("ddp-unused-parameters")
    action = action_for(run.mode, explicit=True, stands_back=False, can_fix=False)
    reason = (
        f"{len(names)} trainable parameter(s) got no gradient at the first optimizer step ({names_of(names)}) under "
        "DDP without find_unused_parameters: " + rule.message
    )
    run.conclude([runtime_decision(rule, action, False, True, reason)], "strict")


def parity_wanted(setting: bool | None, args: Any, model: Any) -> tuple[bool, bool]:
    """Whether to keep the first inputs, and whether the probe runs whatever the audit finds (`forced`)."""
    if setting is not None:
        return setting, setting
    possible = probe.world_size(args) == 1 and not verify.gradients_are_sharded(args, model)
    return possible, possible and bool(ckpt.model_use_reentrant(model))


@dataclass(eq=False)
class Parity:
    """Keeps the first training forward's inputs and compares gradients with and without checkpointing on them."""

    owner: Record
    forced: bool = True
    first: parity.FirstInputs | None = None

    def install(self, model: Any) -> None:
        self.first = parity.FirstInputs(model)
        self.first.install(self.owner.hooks)

    def remove(self) -> None:
        if self.first is not None:
            self.first.remove()
            self.first = None

    def run(self, model: Any, replayed: list[str] | None = None) -> None:
        """Compare; `replayed`: the state the recompute wrote again (`Replay`), judged here on this evidence."""
        run, args = self.owner, self.owner.args
        rule = get_rule("parity-check")
        first = self.first
        self.remove()
        if verify.gradients_are_sharded(args, model):
            run.record([runtime_decision(rule, "none", None, None, "Skipped: sharded parameters.")])
            return
        inputs, batch = (first.inputs, first.batch) if first is not None else (None, None)
        target = ckpt.unwrap(model) if first is not None and first.for_base else model
        result = parity.parity_probe(target, inputs, batch)
        if result.skipped:
            run.record([runtime_decision(rule, "none", None, None, f"Skipped: {result.skipped}.", level="info")])
            return
        summary = (
            f"{result.compared} trainable parameters compared on the {result.batch}: max difference "
            f"{result.max_abs:.3g}, max relative {result.max_rel:.3g} (tolerance {result.rtol:g} of each gradient)"
        )
        action: Action = "none" if result.ok else "warn"
        if result.missing_with_checkpointing:
            action = _refused_or_said(run.mode)
            summary += (
                f"; {len(result.missing_with_checkpointing)} get a gradient only without checkpointing, e.g. "
                f"{result.missing_with_checkpointing[0]}"
            )
        if result.outside:
            summary += f"; {len(result.outside)} differ beyond it, most {result.outside[0]}"
        # far beyond numerical noise on a gradient that counts: the recompute did not compute what the forward did
        if result.far:  # refused here unless the replayed state explains it (`forward-state-replayed` refuses then)
            action = action if replayed else _refused_or_said(run.mode)
            names = ", ".join(result.major[:3]) or "the largest gradients together"
            summary += (
                f"; {len(result.major)} gradient(s) differ by a relative L2 of up to {result.major_rel:.3g}, beyond "
                f"{parity.FAR:g} and far from numerical noise ({names}). The recompute did "
                "not compute what the forward computed: an MoE router routing differently (use_reentrant=False keeps "
                "the routing), a forward context the backward does not re-enter, or state the forward changed"
            )
        after = {
            "max_abs": result.max_abs,
            "max_rel": result.max_rel,
            "compared": result.compared,
            "major_rel": result.major_rel,
        }
        verdicts = [runtime_decision(rule, action, None, after, summary + ".")]
        if replayed and not result.ok:
            verdicts.append(_replay_changes_gradients(run, replayed, summary))
        run.conclude(verdicts)


def _refused_or_said(mode: Mode) -> Action:
    """A failure the plugin has nothing to switch for: refused in strict mode, said in fix and warn mode."""
    action = refused(mode)
    return "warn" if action == "override" else action


def _replay_changes_gradients(run: Record, replayed: list[str], summary: str) -> Decision:
    rule = get_rule("forward-state-replayed")
    reason = (
        f"The state the recompute writes again ({names_of(replayed)}) changes the gradients: the parity probe on the "
        f"first step's inputs differs from no checkpointing ({summary}). The block's output reads that state, so "
        "its recompute computes another function than its forward did. " + rule.message
    )
    return runtime_decision(rule, _refused_or_said(run.mode), None, replayed[:20], reason)
