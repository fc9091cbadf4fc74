"""The memory plan at run time: planned at the first training forward from the batch it really runs, applied to the
live model (`planner.apply_plan`), and checked against what that forward saved (`plan_check.compare`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._base import report
from ..core.decisions import Decision, first_sentence
from ..core.errors import GCConfigError, contained
from ..core.rules import get_rule
from ..core.units import format_bytes
from ..model import ckpt, probe, verify
from ..planning import sharding
from .record import Check, Record, names_of, runtime_decision


def no_plan(why: str) -> Decision:
    why = f"No memory plan: {why}; checkpointing runs as asked."
    return runtime_decision(get_rule("memory-plan"), "warn", None, None, why, level="warning")


def _no_plan_when(run: Record, what: str) -> Callable[[BaseException], None]:
    """What a failure of `what` leaves: no plan, and a decision that says why (training goes on as asked)."""
    return lambda exc: run.record([no_plan(f"{what} failed ({type(exc).__name__}: {exc})")])


class MemoryPlan(Check):
    """Plans how much to checkpoint under `budget` (bytes or `"auto"`) at the first training forward."""

    def __init__(self, run: Record, budget: str | int) -> None:
        super().__init__(run)
        self.budget = budget
        self.comparison: Any = None
        self._grad_share = 1.0

    def install(self, model: Any) -> None:
        """Plan at the first training forward from the batch it really runs (DPO's pairs, GRPO's completions, packed
        rows) and its non-tensor keywords, up to the longest sequence the arguments allow; then check that forward."""
        base, args = ckpt.unwrap(model), self.run.args

        def first_forward(module: Any, f_args: tuple[Any, ...], f_kwargs: dict[str, Any]) -> None:
            import torch

            if not (module.training and torch.is_grad_enabled()):
                return
            self.remove()
            shape = _input_shape(f_args, f_kwargs)
            with contained("the memory plan", lambda exc: self.run.record([no_plan(f"{type(exc).__name__}: {exc}")])):
                keywords = _call_keywords(f_kwargs)
                if shape is not None:
                    planned = self._plan(model, *planned_shape(args, shape), forward_kwargs=keywords)
                else:
                    seq = planned_sequence_length(args)
                    batch = int(getattr(args, "per_device_train_batch_size", 0) or 0)
                    if not (seq and batch):
                        self.run.record([no_plan("the first forward's input shape could not be read")])
                        return
                    planned = self._plan(model, batch, seq)
                if planned is None:
                    return
                self._advise_safely(model, *planned)
                if shape is not None:
                    self._start_check(model, base, planned, shape, keywords)

        # outside the module where torch allows it (a copy of the model made before the first forward carries
        # nothing of the plugin); else a module hook, gone after the first training forward
        handle = self.run.hooks.forward_pre_with_kwargs(base, first_forward)
        if handle is None:
            handle = self.run.hooks.add(base.register_forward_pre_hook(first_forward, with_kwargs=True, prepend=True))
        self._handles = [handle]

    def _plan(self, model: Any, batch: int, seq: int, forward_kwargs: dict[str, Any] | None = None) -> Any:
        """Estimate, plan and apply; the `(estimate, plan)`, or None when skipped."""
        from ..planning import memory, planner

        grad_fraction = self._grad_fraction(model)
        if grad_fraction is None:
            return None
        self._grad_share = grad_fraction
        use_reentrant = ckpt.model_use_reentrant(model)
        planned: list[Any] = []
        # a model the estimate cannot run: as asked
        with contained("the memory plan's estimate", _no_plan_when(self.run, "the estimate")):
            budget = budget_bytes(self.budget, model)
            estimate = memory.estimate(model, batch, seq, forward_kwargs=forward_kwargs)
            gathered = sharding.gathered_parameter_bytes(model, sharding.zero3_window(self.run.args))
            if gathered:
                estimate = dataclasses.replace(estimate, gathered_bytes=gathered)
            plan = planner.plan(
                estimate,
                budget,
                allow_selective=self._selective_allowed(model),
                grad_fraction=grad_fraction,
                **_offload(model),
            )
            planned = [estimate, plan, planner.plan_decisions(plan, self.run.mode)]
        if not planned or not self._apply_plan(model, planned[1], planned[2], use_reentrant):
            return None
        return planned[0], planned[1]

    def install_compiled(self, model: Any, compiled: str) -> None:
        """Under `torch.compile` (`compiled`: why): plan from the arguments' batch shape before the first forward (a
        hook in the forward would run inside dynamo's trace), then either apply the plan's layout (compiled with the
        model) or turn checkpointing off and set torch's `activation_memory_budget` (AOTAutograd's min-cut
        partitioner), set back at the run's end; which, and why, in a decision."""
        from ..planning import planner

        args = self.run.args
        seq = planned_sequence_length(args)
        batch = int(getattr(args, "per_device_train_batch_size", 0) or 0)
        if not (seq and batch):
            why = (
                f"{compiled}, and the arguments give no sequence length (max_length) and batch size: the eager plan "
                "reads the first forward's shape, which torch.compile traces"
            )
            self.run.record([no_plan(why)])
            return
        base = ckpt.unwrap(getattr(model, "_orig_mod", model))
        planned = self._plan(base, batch, seq)
        if planned is None:
            return
        _, plan = planned
        choice = planner.compiled_choice(plan)
        rule = get_rule("memory-plan")
        if choice.way == "partitioner" and self.run.mode != "warn":
            layout_none = plan.get("none")
            planner.apply_plan(base, layout_none, bool(ckpt.model_use_reentrant(base)))
            self.run.ensure_guard(probe.capabilities.installed().layer_kwargs()).record()  # kept across re-enables
            _set_partitioner_budget(self.run, choice.fraction)
            reason = (
                f"Under {compiled}: checkpointing off and torch's activation_memory_budget set to {choice.fraction} "
                f"(the partitioner recomputes op by op to fit it) instead of the plan {plan.chosen.summary()}: "
                f"{choice.why}. Set back to its value at the run's end. Read by the backends that partition with "
                "AOTAutograd's min-cut partitioner (inductor, aot_eager); the eager backend ignores it."
            )
        else:
            reason = (
                f"Under {compiled}: the plan's layout, compiled with the model "
                "(torch's checkpoint is traced as a higher-order op whose regions the partitioner recomputes), "
                f"not torch's activation_memory_budget: {choice.why}."
                + (" Warn mode: nothing was changed." if self.run.mode == "warn" else "")
            )
        after = {
            "way": choice.way,
            "activation_memory_budget": choice.fraction,
            "plan": plan.chosen.name if plan.chosen is not None else None,
        }
        decision = runtime_decision(
            rule,
            "none" if self.run.mode == "warn" else "default",
            None,
            None,
            reason,
            setting="torch_compile_memory_budget",
        )
        self.run.record([dataclasses.replace(decision, after=after)])

    def _advise_safely(self, model: Any, estimate: Any, plan: Any) -> None:
        from ..planning import throughput

        args = self.run.args

        def no_advice(exc: Exception) -> None:
            why = f"No batch advice ({type(exc).__name__}: {exc}); the memory plan stands."
            self.run.record([runtime_decision(get_rule("batch-advice"), "none", None, None, why, level="warning")])

        with contained("the batch advice", no_advice):
            decision = throughput.advice_decision(
                estimate,
                plan.budget,
                getattr(args, "per_device_train_batch_size", None),
                getattr(args, "gradient_accumulation_steps", None),
                allow_selective=self._selective_allowed(model),
                allow_offload=not probe.offload_why_not(model),
                device=_device_kind(model),
                grad_fraction=self._grad_share,
            )
            if decision is not None:
                self.run.record([decision])

    def _grad_fraction(self, model: Any) -> float | None:
        """The share of the parameter gradients this rank holds; None, recorded, where it cannot be read."""
        args = self.run.args
        try:
            fsdp2 = sharding.fsdp2_layout(model)
        except AttributeError as exc:  # another torch's FSDP2 internals
            self.run.record([no_plan(f"FSDP2's state could not be read ({exc})")])
            return None
        if fsdp2 is not None:
            return fsdp2.grad_fraction
        if any(sharding.is_dtensor(p) for p in ckpt.unwrap(model).parameters()):
            # tensor parallelism shards the activations too (each rank holds a slice of the hidden states or heads),
            # which the activation estimate does not model: a plan would be priced on the wrong bytes
            self.run.record([no_plan("not planned under tensor parallelism (DTensor parameters, no FSDP2)")])
            return None
        fsdp1 = sharding.fsdp1_layout(model)
        if fsdp1 is not None:
            return fsdp1.grad_fraction
        sharded = verify.gradients_are_sharded(args, model)
        if not sharded:
            return 1.0
        stage = probe.zero_stage(args)
        if stage in (1, 2, 3) and probe.deepspeed_facts(args) is not None:
            return 1.0 / probe.world_size(args) if stage in (2, 3) else 1.0
        self.run.record([no_plan(f"not planned under sharding ({sharded})")])
        return None

    def _apply_plan(self, model: Any, plan: Any, decisions: list[Decision], use_reentrant: Any) -> bool:
        """Record the plan's decisions and apply its candidate (not in warn mode); False if it could not be."""
        from ..planning import planner

        if self.run.mode == "warn":  # warn mode changes nothing: say what would run
            decisions = [dataclasses.replace(d, action="warn", applied=False) for d in decisions]
        self.run.conclude(decisions)
        chosen = plan.chosen or plan.lowest
        if self.run.mode != "warn" and chosen is not None:
            try:
                planner.apply_plan(model, chosen, bool(use_reentrant))
            except ValueError as exc:  # e.g. blocks the estimate did not count: checkpointing stays as asked
                self.run.record([no_plan(f"it could not be applied ({exc})")])
                return False
            self.run.ensure_guard(probe.capabilities.installed().layer_kwargs()).record()
        report.note(f"memory plan: {first_sentence(decisions[0].reason)}", decisions[0].level, self.run.is_main())
        return True

    def _start_check(
        self, model: Any, base: Any, planned: tuple[Any, Any], shape: tuple[int, int], keywords: dict[str, Any]
    ) -> None:
        """Measure the forward that is starting and compare with the prediction when it ends."""
        from ..planning import memory, plan_check

        metering = memory.meter(model, through=True)  # the user's own saved-tensor hooks see this forward too
        measured = metering.__enter__()
        sample = sharding.held_sampler(model) if planned[0].gathered_bytes else None
        held, stop_held = sharding.watch_held(model, sample) if sample is not None else (None, lambda: None)

        def finish() -> None:
            stop_held()
            metering.__exit__(None, None, None)

        def after(module: Any, f_args: Any, output: Any) -> None:
            self.remove()
            self.run.hooks.discard(metered)  # the meter and the watch go now
            if output is None:  # the forward raised: nothing to compare
                return
            with contained("the memory plan's check", _no_plan_when(self.run, "the check")):
                self._check(model, planned, measured, shape, keywords)
                miss = plan_check.held_miss(planned[0].gathered_bytes, held) if held is not None else None
                if miss is not None:
                    rule = get_rule("memory-plan")
                    self.run.record([runtime_decision(rule, "warn", None, None, miss, setting="memory_plan_check")])

        metered = self.run.hooks.undo(finish)  # at the run's stop, if that forward never ends
        self._handles = [self.run.hooks.forward(base, after)]

    def _check(
        self, model: Any, planned: tuple[Any, Any], measured: Any, shape: tuple[int, int], keywords: dict[str, Any]
    ) -> None:
        """Report a prediction that misses the measurement by more than 15% (fix mode re-plans from it)."""
        from ..planning import memory, plan_check, planner

        estimate, plan = planned
        same = (estimate.batch_size, estimate.seq_len) == shape
        comparison = plan_check.compare(estimate if same else plan_check.scaled(estimate, *shape), measured, model)
        if comparison is not None and comparison.off and not same:
            comparison = plan_check.compare(memory.estimate(model, *shape, forward_kwargs=keywords), measured, model)
        self.comparison = comparison
        if comparison is None or not comparison.off:
            return
        rows, tokens = comparison.batch_shape
        replan = None
        if self.run.mode == "fix":
            fixed = plan_check.corrected(estimate, comparison)
            replan = planner.plan(fixed, plan.budget, allow_selective=self._selective_allowed(model), **_offload(model))
        after = {
            **comparison.to_dict(),
            "planned_shape": [estimate.batch_size, estimate.seq_len],
            "plan": (plan.chosen or plan.lowest).name,
            "replanned": (replan.chosen or replan.lowest).name if replan is not None else None,
        }
        reason = (
            f"The memory plan's prediction misses the first training step: it saved "
            f"{format_bytes(comparison.measured)} for the backward ({comparison.measured} bytes) where "
            f"{format_bytes(comparison.predicted)} ({comparison.predicted} bytes) were predicted for its "
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
        decision = runtime_decision(rule, "warn", "prediction", "measurement", reason, setting="memory_plan_check")
        self.run.record([dataclasses.replace(decision, before=comparison.predicted, after=after)])
        if replan is not None:
            decisions = planner.plan_decisions(replan, self.run.mode)
            self._apply_plan(model, replan, decisions, ckpt.model_use_reentrant(model))

    def _selective_allowed(self, model: Any) -> bool:
        """Selective per-op saving is a candidate: non-reentrant, and no adapter it is not known to be exact for."""
        if ckpt.model_use_reentrant(model) is not False:
            return False
        unsafe = probe.selective_unsafe_adapters(model)
        if unsafe and self.run.count("selective-unsafe-adapters") == 1:
            rule = get_rule("memory-plan")
            why = (
                f"The selective candidate is left out: the model's PEFT adapters ({', '.join(unsafe)}) are not known "
                "to give exact gradients under selective per-op saving (BD-LoRA measured 0.59 off, aLoRA 1.61)."
            )
            self.run.record([runtime_decision(rule, "none", None, None, why, level="info")])
        inside = sharding.units_inside_blocks(model) if not unsafe else []
        if inside and self.run.count("fsdp2-units-inside-blocks") == 1:
            why = (
                f"FSDP2 units inside checkpointed blocks ({names_of(inside, 4)}): "
                "the selective candidates stay on offer. Upstream, selective checkpointing around an inner unit has "
                "failed at the first backward ('invocation index N encountered during backward but not found in "
                "storage': torchtitan #3427, with expert parallelism); here (torch 2.13 and 2.15, 2 ranks, an inner "
                "unit per MLP) it trains with the gradients of full checkpointing. Where it fails, leave the "
                "memory budget out (full checkpointing)."
            )
            self.run.record([runtime_decision(get_rule("memory-plan"), "none", None, None, why, level="info")])
        return not unsafe


def _set_partitioner_budget(run: Record, fraction: float | None) -> None:
    """Set `torch._functorch.config.activation_memory_budget`; the run's end sets back the value it found."""
    from torch._functorch import config

    before = config.activation_memory_budget
    config.activation_memory_budget = fraction
    run.hooks.undo(lambda: setattr(config, "activation_memory_budget", before))


def budget_bytes(budget: str | int, model: Any) -> int:
    """`auto`: the free CUDA memory less an Adam state (8 bytes per trainable parameter), less 10%."""
    if budget != "auto":
        return int(budget)
    import torch

    if not torch.cuda.is_available():
        raise GCConfigError('memory_budget="auto" reads the free CUDA memory; give a size ("40GiB") on this machine.')
    free, _ = torch.cuda.mem_get_info()
    optimizer = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(int((free - optimizer) * 0.9), 1)


def planned_sequence_length(args: Any) -> int | None:
    """The longest sequence the arguments allow (`max_length`, GRPO's prompt + completion)."""
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    prompt, completion = getattr(args, "max_prompt_length", None), getattr(args, "max_completion_length", None)
    if isinstance(prompt, int) and isinstance(completion, int) and prompt > 0 and completion > 0:
        return prompt + completion
    return None


def planned_shape(args: Any, shape: tuple[int, int]) -> tuple[int, int]:
    """The first forward's rows and the longest sequence the arguments allow; a padding-free or packed row holds
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
    """The non-tensor keywords of a model call (`fused_lm_head=True`): the estimate takes the same path."""
    import torch

    return {
        k: v
        for k, v in kwargs.items()
        if k not in ("input_ids", "labels", "inputs_embeds")
        and not isinstance(v, torch.Tensor)
        and (v is None or isinstance(v, bool | int | float | str))
    }


def _offload(model: Any) -> dict[str, Any]:
    why = probe.offload_why_not(model)
    return {"allow_offload": not why, "offload_why_not": why, "device": _device_kind(model)}


def _device_kind(model: Any) -> str:
    for parameter in model.parameters():
        return "cpu" if parameter.device.type == "cpu" else "cuda"
    return "cpu"


def _input_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    import torch

    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *(args[:1] or ())):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return None
