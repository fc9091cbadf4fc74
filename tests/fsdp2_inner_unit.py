"""Run under `torchrun --nproc_per_node 2` (gloo, CPU): FSDP2 with a unit inside each checkpointed block (each decoder
layer's MLP is its own `fully_shard` unit, as a per-module wrapping policy or a MoE's experts give), the tiny Llama
checkpointed non-reentrant with each layout, one forward and backward, no Trainer.

    torchrun --nproc_per_node 2 tests/fsdp2_inner_unit.py OUTDIR SCENARIO [SCENARIO ...]

A scenario is `<layout>-<inner>`: layout `full` | `selective` | `lean` (the plugin's policies, `ckpt.apply`); inner
`inner` (the MLPs are units of their own) or `flat` (only the layers and the model). Each rank writes the outcome
(`ok` or the error), the plugin's reading of the layout (`sharding.units_inside_blocks`), and, for `ok`, a checksum
of the gradients.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torchrun import write_results


def run(out: str, scenario: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    from trl_gc_plugin.core.layout import Layout
    from trl_gc_plugin.model import ckpt
    from trl_gc_plugin.planning import sharding
    from trl_gc_plugin.testing import make_model

    layout, inner = scenario.split("-")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = make_model(num_hidden_layers=2)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        if inner == "inner":
            fully_shard(layer.mlp)
        fully_shard(layer)
    fully_shard(model)
    if layout != "full":
        ckpt.apply(model, ckpt.Spec(layout=Layout.uniform(layout, len(model.model.layers))))
    result = {"scenario": scenario, "rank": dist.get_rank(), "inside": sharding.units_inside_blocks(model)}
    # What the memory plan says about such a model: selective stays on offer, with a note naming the inner units.
    from trl_gc_plugin.core.settings import GCSettings
    from trl_gc_plugin.runtime.memory_plan import MemoryPlan
    from trl_gc_plugin.runtime.record import Record

    record = Record(GCSettings.resolve({}, installed={}, environ={}), write_json=False)
    plan = MemoryPlan(record, "1GiB")
    result["selective_offered"] = [plan._selective_allowed(model) for _ in range(2)]
    result["notes"] = [d.reason for d in record.decisions]
    ids = torch.randint(3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as exc:  # the outcome under test
        result["outcome"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    else:
        result["outcome"] = "ok"
        result["grad_sum"] = float(sum(p.grad.full_tensor().double().sum() for p in model.parameters() if p.grad is not None))
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    write_results(sys.argv[1], sys.argv[2:], run)
