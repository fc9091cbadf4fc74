"""The checks of the first training forward: what enters each checkpointed block (`FirstForward`), and a second
forward before the first backward under per-parameter gradient reduction (`TwoForwards`)."""

from __future__ import annotations

from typing import Any

from ..core.decisions import Action
from ..core.policy import action_for
from ..core.rules import Rule, get_rule
from ..model import ckpt
from ..model.observe import Call, Observation, Verdict
from .record import Check, Record, runtime_decision

_VERDICT: dict[str, Verdict] = {"warn": "report", "error": "raise"}  # else repair


def not_running(run: Record, why: str) -> None:
    rule = get_rule("checkpointing-not-running")
    reason = f"Checkpointing is asked for but {why}. " + rule.message
    run.record([runtime_decision(rule, "warn", True, False, reason)])


class FirstForward:
    """Judges what the first training forward passes to each reentrant checkpointed block."""

    def __init__(self, run: Record) -> None:
        self.run = run
        self.observation: Observation | None = None
        self.observed: dict[str, Call] = {}

    def install(self, model: Any) -> None:
        self.observation = Observation(model, self.run.hooks, self.on_frozen_inputs, self.on_keyword_inputs)
        self.observation.install()

    def remove(self) -> None:
        if self.observation is not None:
            self.observation.remove()
            self.observation = None

    def finish(self, asked: bool) -> None:
        """The first step is over: keep what was observed, drop the hooks; say so if every forward ran in eval mode."""
        observation = self.observation
        if observation is None:
            return
        self.remove()
        self.observed = dict(observation.calls)
        if asked and not self.observed and observation.eval_forwards:
            not_running(self.run, "the first training step's forwards ran in eval mode, so no block checkpointed")

    def on_frozen_inputs(self, call: Call) -> Verdict:
        run = self.run
        rule = get_rule("frozen-inputs-observed")
        explicit, source = run.explicit()
        action = action_for(run.mode, explicit=explicit, stands_back=run.stands_back())
        if action == "warn" and run.count("frozen-inputs") > 1:  # said once; the audit lists every block
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
        return self._found(rule, action, verdict, reason)

    def on_keyword_inputs(self, call: Call, shared_with: str | None) -> Verdict:
        """Certain failure once a second block gets the same tensor (`shared_with`)."""
        run = self.run
        rule = get_rule("reentrant-keyword-inputs")
        explicit, source = run.explicit()
        names = ", ".join(call.keyword_inputs)
        action = action_for(run.mode, explicit=explicit, stands_back=run.stands_back())
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
        if run.count("keyword-inputs") > 1:
            return verdict if verdict != "raise" else "keep"
        return self._found(rule, action, verdict, reason)

    def _found(self, rule: Rule, action: Action, verdict: Verdict, reason: str) -> Verdict:
        self.run.conclude([runtime_decision(rule, action, True, verdict != "repair", reason)])
        if verdict == "repair":
            self.run.switch(False)
        return verdict


class TwoForwards(Check):
    """A second forward before the first backward, reentrant, under per-parameter gradient reduction (ZeRO, DDP)."""

    def install(self, model: Any) -> None:
        base = ckpt.unwrap(model)
        state = {"pending": False}

        def before(module: Any, f_args: Any) -> None:
            import torch

            if not (module.training and torch.is_grad_enabled()):
                return
            if state["pending"]:
                self.remove()
                self._found()
            state["pending"] = True

        def after(module: Any, f_args: Any, output: Any) -> None:
            tensor = grad_output(output)
            if tensor is None:
                state["pending"] = False
                return
            tensor.register_hook(lambda grad: state.update(pending=False))

        self._handles = [self.run.hooks.forward_pre(base, before), self.run.hooks.forward(base, after)]

    def _found(self) -> None:
        run = self.run
        rule = get_rule("two-forwards-before-backward")
        action = action_for(run.mode, explicit=True, stands_back=run.stands_back(), can_fix=False)
        reason = (
            "A second grad-enabled forward of the model ran before the first backward, with reentrant checkpointing, "
            "under a wrapper that reduces each parameter's gradient once per backward. " + rule.message
        )
        run.conclude([runtime_decision(rule, action, True, False, reason)], "strict")  # fix mode refuses as strict


def grad_output(output: Any) -> Any:
    """A tensor of the model's output that requires grad (the loss, else the logits, else the first one)."""
    import torch

    candidates = [getattr(output, name, None) for name in ("loss", "logits")]
    if isinstance(output, (tuple, list)):
        candidates += list(output)
    elif isinstance(output, torch.Tensor):
        candidates.append(output)
    return next((t for t in candidates if isinstance(t, torch.Tensor) and t.requires_grad), None)
