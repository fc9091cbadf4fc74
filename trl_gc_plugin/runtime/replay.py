"""Rule `forward-state-replayed`: state a checkpointed forward writes besides its output (a counter, MoE
tokens-per-expert, BatchNorm statistics) is written again by the recompute, so every batch counts double. Read once,
at the end of the first training forward and at the end of its backward (no tensor kept, nothing on the model).
"""

from __future__ import annotations

import numbers
from typing import Any

from .._base import report
from ..core.errors import contained
from ..core.rules import get_rule
from ..model import ckpt
from .first_forward import grad_output
from .record import Check, Record, names_of, runtime_decision

State = dict[str, Any]

# other libraries' bookkeeping a recompute legitimately changes again: DeepSpeed ZeRO-3 counts its pre-backward hooks
# on every module it partitions (`deepspeed/runtime/zero/parameter_offload.py`, 0.19.8); its others start with `ds_`
NOT_MODEL_STATE = frozenset({"applied_pre_backward_ref_cnt"})


def read_state(base: Any) -> State:
    """Per checkpointing block: `<module>.<buffer>` -> (version, sum) and `<module>.<attribute>` -> number."""
    import torch

    active = {id(m) for m, _ in ckpt.functions(base)}
    names = {id(m): n for n, m in base.named_modules()}
    sums: list[tuple[str, int, Any]] = []
    state: State = {}
    for block in ckpt.blocks(base):
        if id(block) not in active:
            continue
        prefix = names.get(id(block), type(block).__name__)
        for sub_name, module in block.named_modules():
            where = f"{prefix}.{sub_name}" if sub_name else prefix
            for key, value in vars(module).items():
                if key.startswith(("_", "ds_")) or key in NOT_MODEL_STATE or isinstance(value, bool):
                    continue
                if isinstance(value, numbers.Number):
                    state[f"{where}.{key}"] = value
            for key, buffer in module._buffers.items():
                if isinstance(buffer, torch.Tensor):
                    sums.append((f"{where}.{key}", buffer._version, buffer.detach().sum(dtype=torch.float64)))
    for name, version, total in sums:
        state[name] = (version, float(total.item()))
    return state


def changed(before: State, after: State) -> list[str]:
    """The names whose value differs (a buffer rewritten with the same values is not a change)."""
    out = []
    for name, old in before.items():
        new = after.get(name, old)
        if isinstance(old, tuple):
            if new[0] != old[0] and new[1] != old[1]:
                out.append(name)
        elif new != old:
            out.append(name)
    return out


class Replay(Check):
    def __init__(self, run: Record) -> None:
        super().__init__(run)
        self.found: list[str] | None = None

    def install(self, model: Any) -> None:
        base = ckpt.unwrap(model)

        def after_forward(module: Any, f_args: Any, output: Any) -> None:
            import torch

            if not (module.training and torch.is_grad_enabled()):
                return
            self.remove()
            tensor = grad_output(output)
            if tensor is None:  # the loss is computed elsewhere: no backward to wait for
                return
            try:
                before = read_state(module)
            except Exception:  # an unreadable module: no check rather than a failed step
                return
            if not before:
                return

            def at_backward_end() -> None:
                with contained("the replayed-state check", skipped):
                    self._judge(changed(before, read_state(module)))

            def on_grad(grad: Any) -> None:
                torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)

            tensor.register_hook(on_grad)

        self._handles = [self.run.hooks.forward(base, after_forward)]

    def _judge(self, names: list[str]) -> None:
        self.found = names
        if not names:
            return
        rule = get_rule("forward-state-replayed")
        reason = (
            f"{len(names)} value(s) written by a checkpointed block's forward were written again by its recompute in "
            f"the first backward ({names_of(names)}): every batch updates them twice. " + rule.message
        )
        self.run.record([runtime_decision(rule, "warn", None, names[:20], reason)])


def skipped(exc: Exception) -> None:
    report.note(f"the replayed-state check failed ({type(exc).__name__}: {exc}); skipped", "info")
