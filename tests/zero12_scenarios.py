"""Run under `torchrun --nproc_per_node 2` (gloo, CPU; `DS_ACCELERATOR=cpu` for DeepSpeed): a parameter that receives
gradients from more than one *reentrant* checkpointed call in one backward, under DeepSpeed ZeRO-1/2 and torch DDP.

    torchrun --nproc_per_node 2 tests/zero12_scenarios.py OUTDIR SCENARIO [SCENARIO ...]

Reentrant checkpointing runs a separate inner backward per checkpointed call, so a parameter used by two such calls
(two forwards of the model before one backward, or one block called twice in a forward, e.g. Zamba2's shared
transformer block) has its gradient *accumulated twice* in one backward, and every per-parameter gradient hook fires
twice. ZeRO-2 (and ZeRO-1 with `overlap_comm`) reduces a parameter in that hook and asserts it happens once:
`AssertionError: The parameter ... has already been reduced. Gradient computed twice for this partition.`
(deepspeed/runtime/zero/stage_1_and_2.py, reduce_independent_p_g_buckets_and_remove_grads). torch DDP marks the
parameter ready in that hook: `RuntimeError: Expected to mark a variable ready only once` (even with
`find_unused_parameters=False`; `static_graph=True` accepts it). ZeRO-3 raises nothing and keeps one of the
contributions: the checkpointed layers' parameters get the gradient of the first forward only (DeepSpeed 0.19.8).
Non-reentrant checkpointing recomputes inside the one autograd graph, so each parameter's gradient is accumulated
once.

Two kinds of scenario:

`raw-<stage>-<pattern>-<gc>-<overlap>`: the tiny Llama (or Zamba2) in a raw `deepspeed.initialize` engine (or a
  torch DDP wrapper), SGD lr 1.0, one optimizer step, fixed per-rank batches.
  stage    `1` | `2` | `3` (ZeRO stage, contiguous_gradients on; ZeRO-3 partitions every parameter) | `ddp` (DDP,
           find_unused off) | `ddpstatic` (static_graph)
  pattern  `single` (one forward) | `twofwd` (two grad forwards, one backward of the summed loss) |
           `nograd2` (second forward under no_grad, as TRL's reference passes) | `shared` (Llama whose layer 0 is
           called again as a third layer) | `zamba2` (a real HF model whose hybrid layers share one transformer
           block) | `ga2` (gradient accumulation 2, one forward per micro step) | `first` (the first forward of
           `twofwd` alone)
  gc       `none` | `reentrant` | `nonreentrant`
  overlap  `0` | `1` (`zero_optimization.overlap_comm`; ignored for DDP)
  DeepSpeed's default gradient clipping (1.0) is turned off so that the update is the gradient. Rank 0 saves the
  (gathered) parameters after the step, {name: tensor}, to OUTDIR/<scenario>.pt (the test compares runs).

`trainer-<stage>-<model>-<gc>-<plugin>`: the real HF Trainer (or TRL's DPO/GRPO trainer), 2 steps.
  stage    `1` (ZeRO-1, overlap_comm off: DeepSpeed's default for stages 1/2) | `1o` (ZeRO-1, overlap_comm on) |
           `2` (ZeRO-2, overlap_comm off) | `3` (ZeRO-3, everything partitioned) | `ddp` (DDP, no DeepSpeed;
           `ddp_find_unused_parameters` left to the Trainer: False for a PreTrainedModel with checkpointing on)
  model    `llama` | `llama2fwd` (a Trainer subclass whose compute_loss runs the model twice and averages: a
           siamese / multi-loss user pattern, as in DeepSpeedExamples issue 458) | `zamba2` | `dpo` | `grpo`
           (TRL 1.16 DPOTrainer with a separate reference model / GRPOTrainer, tiny Llama)
  gc       `true` | `false` | `unset` (use_reentrant)
  plugin   `none` | `strict` | `fix` | `budget` (strict, memory budget midway between the predicted peaks of no and
           full checkpointing, gradients sharded over the ranks under ZeRO-2)
  Recorded: the outcome, how many grad-enabled forwards of the model ran before the first backward (seen by a
  forward pre-hook, counted until `accelerator.backward` is first called), how many trainable parameters are
  shared by two or more entries of the model's layer list (static), the decisions, and a checksum of the trainable
  parameters of every rank.

Each rank appends one JSON line per scenario to OUTDIR/results-rank<R>.jsonl.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist
from torchrun import write_results
from transformers import TrainerCallback

ZERO_CPU = {"zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9}


def make_zamba2():
    """A tiny Zamba2 (mamba, hybrid, mamba, hybrid): both hybrid layers run the same shared transformer block."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    from trl_gc_plugin.testing import make_tokenizer

    tokenizer = make_tokenizer()
    config = Zamba2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=4,
                          layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_attention_heads=4,
                          num_key_value_heads=4, attention_head_dim=16, mamba_d_state=8, mamba_headdim=8,
                          n_mamba_heads=16, mamba_ngroups=1, intermediate_size=128, max_position_embeddings=128,
                          pad_token_id=tokenizer.pad_token_id, use_cache=False,
                          chunk_size=16)  # the torch fallback of the mamba scan pads to a chunk: 256 is 40x slower
    torch.manual_seed(0)
    return Zamba2ForCausalLM(config).float()


def shared_layer_params(model) -> int:
    """Trainable parameters that belong to two or more entries of the model's `layers` list (static check)."""
    layers = next((m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)),
                  None)
    if layers is None:
        return 0
    owners: dict[int, int] = {}
    for layer in layers:  # a ModuleList iterates repeated entries too
        for p in {id(p): p for p in layer.parameters()}.values():
            if p.requires_grad:
                owners[id(p)] = owners.get(id(p), 0) + 1
    return sum(count > 1 for count in owners.values())


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def run_raw(out: str, scenario: str) -> dict:
    _, stage, pattern, gc, overlap = scenario.split("-")
    rank = dist.get_rank()
    if pattern == "zamba2":
        model = make_zamba2()
    else:
        from trl_gc_plugin.testing import make_model

        model = make_model(num_hidden_layers=3) if pattern == "shared" else make_model()
        if pattern == "shared":
            layers = model.model.layers
            model.model.layers = torch.nn.ModuleList([layers[0], layers[1], layers[0]])
    if gc != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": gc == "reentrant"})
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    accumulation = 2 if pattern == "ga2" else 1
    if stage.startswith("ddp"):
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False,
                                                        static_graph=stage == "ddpstatic")

        class Engine:
            def __call__(self, **batch):
                return ddp(**batch)

            def backward(self, loss):
                loss.backward()

            def step(self):
                optimizer.step()
                optimizer.zero_grad()

        engine = Engine()
    else:
        import deepspeed

        zero = {"stage": int(stage), "overlap_comm": overlap == "1", "contiguous_gradients": True,
                "reduce_bucket_size": 5000, "allgather_bucket_size": 5000}
        if stage == "3":  # partition even this tiny model
            zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=1000)
        # gradient_clipping 0: DeepSpeed clips at 1.0 by default, which would hide the size of a gradient
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
                  "zero_optimization": zero, "gradient_clipping": 0.0, **ZERO_CPU}
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    result: dict = {"scenario": scenario, "rank": rank, "shared_layer_params": shared_layer_params(model)}
    first, second = _batch(10 + rank), _batch(20 + rank)
    started = time.time()
    try:
        if pattern == "twofwd":
            engine.backward(engine(**first).loss + engine(**second).loss)
            engine.step()
        elif pattern == "first":  # the first forward of `twofwd` alone
            engine.backward(engine(**first).loss)
            engine.step()
        elif pattern == "nograd2":
            loss = engine(**first).loss
            with torch.no_grad():
                extra = engine(**second).loss
            engine.backward(loss + 0 * extra)
            engine.step()
        elif pattern == "ga2":
            for batch in (first, second):
                engine.backward(engine(**batch).loss)
                engine.step()  # DeepSpeed steps the optimizer at the accumulation boundary only
        else:
            engine.backward(engine(**first).loss)
            engine.step()
        result["outcome"] = "trained"
    except Exception as exc:  # reported, not raised: the test reads the outcome
        result["outcome"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    result["seconds"] = round(time.time() - started, 2)
    with _gathered(model, stage == "3"):
        params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    result["checksum"] = float(sum(t.sum() for t in params.values()))
    if rank == 0:
        torch.save(params, os.path.join(out, f"{scenario}.pt"))
    return result


def _gathered(model, zero3: bool):
    """The full parameters: gathered from their ZeRO-3 partitions (a collective), else as they are."""
    import contextlib

    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def gloo_for_deepspeed_on_cpu() -> None:
    """Test-only (as in benchmarks/zero3_old_deepspeed.py and shared/upstream-facts.md): without a GPU, accelerate
    picks no process-group backend when DeepSpeed is on and every rank believes it is alone; give it gloo."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if getattr(PartialState._prepare_backend, "_gloo_for_deepspeed", False):
        return
    original = PartialState._prepare_backend

    def prepare(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if chosen is None and os.environ.get("LOCAL_RANK") and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            return "gloo", DistributedType.MULTI_CPU
        return chosen, kind

    prepare._gloo_for_deepspeed = True
    PartialState._prepare_backend = prepare


def run_trainer(out: str, scenario: str) -> dict:
    from trainers import make_trainer
    from transformers import Trainer

    from trl_gc_plugin import SafeGCCallback
    from trl_gc_plugin.model.ckpt import model_use_reentrant

    _, stage, model_kind, gc, plugin = scenario.split("-")
    rank = dist.get_rank()
    result: dict = {"scenario": scenario, "rank": rank}
    if model_kind == "zamba2":
        model = make_zamba2()
    else:
        from trl_gc_plugin.testing import make_model

        model = make_model()
    result["shared_layer_params"] = shared_layer_params(model)
    counts = {"forwards": 0, "backward_started": False}

    def count_forward(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and not counts["backward_started"]:
            counts["forwards"] += 1

    hook = model.register_forward_pre_hook(count_forward, with_kwargs=True)
    zero: dict = {"stage": int(stage[0]) if stage != "ddp" else 0, "overlap_comm": stage == "1o"}
    if stage == "3":
        zero.update(overlap_comm=True, stage3_param_persistence_threshold=0, reduce_bucket_size=1000,
                    stage3_prefetch_bucket_size=1000)
    extra: dict = {"ddp_backend": "gloo"} if stage == "ddp" else {"use_cpu": False, "deepspeed": {
        "zero_optimization": zero, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "zero_force_ds_cpu_optimizer": False}}
    if plugin == "budget":  # strict, with a budget midway between the predicted peaks of no and full checkpointing
        from trl_gc_plugin.core.layout import Layout
        from trl_gc_plugin.planning import memory, planner

        est = memory.estimate(model, 2, 16)  # the Trainer's batch: 2 rows of the 16-token tokenized dataset
        n, share = est.num_blocks, 1.0 / dist.get_world_size() if stage in ("2", "3") else 1.0
        if stage == "3":  # ZeRO-3 keeps what it uses again within 1e9 elements (its default reuse distance): all here
            whole = sum(p.numel() * p.element_size() for p in model.parameters())
            est = dataclasses.replace(est, gathered_bytes=whole)
        peaks = [planner.predict_peak(est, Layout.from_pattern((on,) * n), grad_fraction=share)[0] for on in (False, True)]
        callbacks = [SafeGCCallback(mode="strict", memory_budget=sum(peaks) // 2)]
        if stage == "3":  # what ZeRO-3 really holds whole, against the plan's gathered-parameter term
            callbacks.append(_Held())
    else:
        callbacks = [SafeGCCallback(mode=plugin)] if plugin != "none" else []
    gc_kwargs = None if gc == "unset" else {"use_reentrant": gc == "true"}
    kind = model_kind if model_kind in ("dpo", "grpo") else "trainer"
    trainer = None
    started = time.time()
    try:
        result["where"] = "Trainer"
        trainer = make_trainer(kind, model, os.path.join(out, scenario), gc=True, gc_kwargs=gc_kwargs,
                               callbacks=callbacks, max_steps=2, logging_steps=1, **extra)
        if model_kind == "llama2fwd":
            trainer.compute_loss = _two_forward_loss.__get__(trainer, Trainer)
        backward = trainer.accelerator.backward

        def first_backward(loss, **kwargs):
            if not counts["backward_started"]:
                counts["backward_started"] = True
                result["grad_forwards_before_backward"] = counts["forwards"]
            return backward(loss, **kwargs)

        trainer.accelerator.backward = first_backward  # instrumentation only: counts, then calls the real one
        result["where"] = "train"
        trainer.train()
        result["outcome"] = "trained"
    except Exception as exc:  # reported, not raised: the test reads the outcome
        result["outcome"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    hook.remove()
    for held in [c for c in callbacks if isinstance(c, _Held)]:
        held.remove()
        result["held"] = held.record
    result["seconds"] = round(time.time() - started, 2)
    result["running"] = model_use_reentrant(model)
    if callbacks:
        result["decisions"] = [[d.rule_id, d.action] for d in callbacks[0].decisions]
        result["warnings"] = [d.reason for d in callbacks[0].decisions if d.level in ("warning", "error")]
        result["plans"] = [[d.after["plan"], d.after["estimate"]["grad_fraction"]] for d in callbacks[0].decisions
                           if d.rule_id == "memory-plan" and isinstance(d.after, dict) and "estimate" in d.after]
        result["gathered_predicted"] = [d.after["estimate"]["gathered_bytes"] for d in callbacks[0].decisions
                                        if d.rule_id == "memory-plan" and isinstance(d.after, dict)
                                        and "estimate" in d.after]
    if trainer is not None and result["outcome"] == "trained":
        with _gathered(model, stage == "3"):
            total = torch.stack([p.detach().double().sum() for p in model.parameters() if p.requires_grad]).sum()
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, total.reshape(1))
        result["checksums"] = [float(g) for g in gathered]
    return result


class _Held(TrainerCallback):
    """Measures what ZeRO-3 holds whole (`held.watch`), from the start of training, after DeepSpeed's hooks."""

    record: dict | None = None
    remove = staticmethod(lambda: None)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from held import watch, zero3_whole

        self.record, self.remove = watch(model, zero3_whole)


def _two_forward_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """compute_loss of a user Trainer subclass: two grad-enabled forwards of the model, one loss, one backward."""
    first = model(**inputs)
    second = model(**inputs)
    loss = (first.loss + second.loss) / 2
    return (loss, first) if return_outputs else loss


def main() -> None:
    out, scenarios = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/trainers.py
    if any(s.startswith("trainer-") and not s.startswith("trainer-ddp") for s in scenarios):
        gloo_for_deepspeed_on_cpu()
    if any(s.startswith("raw-") and not s.startswith("raw-ddp") for s in scenarios):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif not dist.is_initialized():
        dist.init_process_group("gloo")
    write_results(out, scenarios, lambda out, s: (run_raw if s.startswith("raw-") else run_trainer)(out, s))

if __name__ == "__main__":
    main()
