"""Run under `torchrun --nproc_per_node 2`: a DDP training loop without a Trainer (gloo, CPU), the model route.

    torchrun --nproc_per_node 2 tests/loop_scenarios.py OUTDIR SCENARIO [SCENARIO ...]

A scenario is `[accelerate-]<mode>`, mode `none`, `strict` or `fix`: a tiny Llama with frozen input embeddings,
`gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})`, torch DDP (its defaults) or,
with `accelerate-`, `Accelerator.prepare` and `accelerator.backward` (accelerate wraps the model in DDP on its own),
two SGD steps; with a mode, `trl_gc_plugin.installed(mode)` around it (the patched enable method arms the route).
Each rank appends one JSON line: the outcome (`trained` or the exception type and first line), how many
decoder-layer tensors changed, and a checksum of the trainable parameters (the ranks stay in sync).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torchrun import write_results

from trl_gc_plugin import installed
from trl_gc_plugin.testing import make_model


def run(out: str, scenario: str) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    result: dict = {"scenario": scenario, "rank": dist.get_rank()}
    accelerated = scenario.startswith("accelerate-")
    mode = scenario.removeprefix("accelerate-")
    scope = contextlib.nullcontext() if mode == "none" else installed(mode)
    model = make_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with scope:
            model.train()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
            if accelerated:
                from accelerate import Accelerator

                accelerator = Accelerator(cpu=True)
                wrapped, opt = accelerator.prepare(model, opt)
                backward = accelerator.backward
            else:
                wrapped = torch.nn.parallel.DistributedDataParallel(model)
                backward = torch.Tensor.backward
            for step in range(2):
                ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
                backward(wrapped(input_ids=ids, labels=ids).loss)
                opt.step()
                opt.zero_grad()
        result["outcome"] = "trained"
    except Exception as exc:  # the outcome is the result
        result["outcome"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    result["layers_changed"] = sum(
        1 for n, p in model.named_parameters() if ".layers." in n and not torch.equal(p, before[n])
    )
    result["layers"] = sum(1 for n, p in model.named_parameters() if ".layers." in n)
    result["checksum"] = float(sum(p.detach().double().sum() for p in model.parameters() if p.requires_grad))
    return result


def main() -> None:
    out, scenarios = sys.argv[1], sys.argv[2:]
    write_results(out, scenarios, run)


if __name__ == "__main__":
    main()
