"""Run under `torchrun --nproc_per_node 2`: real FSDP (FSDP1 and FSDP2) through the HF Trainer on CPU (gloo), with a
test-only accelerate shim, on the tiny Llama.

    torchrun --nproc_per_node 2 tests/fsdp_scenarios.py OUTDIR SCENARIO [SCENARIO ...]

Why a shim: on a machine without an accelerator, `TrainingArguments(use_cpu=True)` makes accelerate's `PartialState`
pick `DistributedType.MULTI_CPU` with gloo, and `AcceleratorState.__init__` (accelerate 1.15, state.py, the branch
`elif self.distributed_type in [DistributedType.MULTI_GPU, ...]`) only turns a `fsdp_plugin` into
`DistributedType.FSDP` for accelerator types; MULTI_CPU is not in the list, so the plugin is dropped,
`Trainer.is_fsdp_enabled` is False and the model is wrapped in DDP, silently. Without `use_cpu`, no backend is
chosen and `Trainer.__init__` raises "Using fsdp only works in distributed training.". `fsdp_on_cpu()` below
finishes what accelerate skipped: when a `fsdp_plugin` is given and the state is MULTI_CPU, it sets
`distributed_type = FSDP` and keeps the plugin (for FSDP1 it also sets the device to `torch.device("cpu")`: torch's
FSDP1 refuses `device_id=cpu:0` against compute device `cpu`). Everything else (the Trainer, accelerate's
`prepare_model`, torch's `fully_shard` / `FullyShardedDataParallel`, `checkpoint_wrapper`) is the real code. As
with the DeepSpeed gloo shim (shared/upstream-facts.md), this is a test-only workaround, never plugin code.

A scenario is `<fsdp>-<model>-<gc>-<ac>-<cache>-<plugin>`:
  fsdp    `v1` or `v2` (FSDP version; through the shim), `v1g` / `v2g` (the same with `shard_grad_op`: no reshard
          after forward), `ddp` / `ddp1` (FSDP2 / FSDP1 asked for, no shim: what users get on a CPU-only machine)
  model   `full` | `frozenemb` (input embeddings frozen) | `lora` (LoRA q/v, no input hook) | `lorahook` (LoRA +
          `enable_input_require_grads()`) | `dropout` (attention_dropout=0.1, one step only) | `loradrop` (LoRA
          with lora_dropout=0.1, one step only) | `tied` (input and output embeddings tied) | `deep` (4 layers)
  gc      the Trainer's checkpointing: `off` | `unset` (on, kwargs None) | `true` | `false` (use_reentrant)
  ac      FSDP's own activation checkpointing (`fsdp_config["activation_checkpointing"]`): `0` | `1`
  cache   `model.config.use_cache`: `0` | `1`; `2`: also `TrainingArguments(use_cache=True)` (transformers >= 5
          copies `args.use_cache` into the model config at the end of `Trainer.__init__`)
  plugin  `none` | `strict` | `fix` (SafeGCCallback) | `installed` | `installedfix` (trl_gc_plugin.installed()
          around the arguments and the trainer) | `budget` (strict, a memory budget midway between the predicted
          peaks of no and full checkpointing) | `unshard` (the same, and a callback unshards every FSDP2 group
          at train begin)

Each rank appends one JSON line per scenario to OUTDIR/results-rank<R>.jsonl: where it stopped and the outcome,
what `fsdp_wrapping()` sees at `on_init_end` and `on_train_begin`, the wrapper, the losses, how many trainable
layer parameters changed (full tensors gathered from the shards), a checksum of them on every rank, the effective
use_reentrant, the decisions. Rank 0 also saves the gathered trainable parameters to OUTDIR/<scenario>.pt.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torchrun import write_results

FLAG = {"unset": None, "true": True, "false": False}
_SHIM_ON = {"on": False}


def fsdp_on_cpu() -> None:
    """Test-only: let accelerate keep a FSDP plugin on a CPU-only (MULTI_CPU, gloo) launch. See the module doc."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_fsdp_on_cpu", False):
        return
    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if _SHIM_ON["on"] and fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            if fsdp_plugin.fsdp_version == 1:
                self.device = PartialState._shared_state["device"] = torch.device("cpu")

    init._fsdp_on_cpu = True
    AcceleratorState.__init__ = init


def fsdp_wrapping(model, args=None) -> dict:
    """What really wraps the model, as a TrainerCallback can see it.

    `structure`: "fsdp2" (a `torch.distributed.fsdp.FSDPModule` in the module tree, parameters are DTensors), "fsdp1"
    (a `FullyShardedDataParallel` module: the root itself at `on_train_begin`, the Trainer hands the wrapper to the
    callbacks), or None (plain modules: not wrapped yet at `on_init_end`, or DDP/none, whose wrapper the callbacks
    never see). `state`: accelerate's distributed type as the Trainer left it on `args.distributed_state`
    ("FSDP", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", ...); set in `Trainer.__init__` (before `on_init_end`).
    `fsdp_requested`: `args.fsdp` or `ACCELERATE_USE_FSDP` (accelerate sets the variable itself as soon as a FSDP
    plugin is passed, even when it then uses DDP: it tells what was asked for, not what runs).
    `verdict`: "fsdp1" / "fsdp2" when the structure shows it; "fsdp" when only the state says FSDP (on_init_end);
    "not-fsdp" when FSDP was requested but the state is not FSDP (accelerate fell back to DDP / MULTI_CPU);
    None when FSDP was not requested."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor

    modules = list(model.modules()) if model is not None else []
    fsdp2 = sum(isinstance(m, FSDPModule) for m in modules)
    fsdp1 = sum(isinstance(m, FullyShardedDataParallel) for m in modules)
    dtensors = sum(isinstance(p, DTensor) for p in model.parameters()) if model is not None else 0
    structure = "fsdp2" if fsdp2 else "fsdp1" if fsdp1 else None
    state = getattr(getattr(args, "distributed_state", None), "distributed_type", None)
    state = str(state).rsplit(".", 1)[-1] if state is not None else None
    requested = bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in (
        "1", "true", "yes")
    if structure:
        verdict = structure
    elif state == "FSDP":
        verdict = "fsdp"
    elif requested:
        verdict = "not-fsdp"
    else:
        verdict = None
    return {"structure": structure, "state": state, "fsdp_requested": requested, "verdict": verdict,
            "fsdp2_modules": fsdp2, "fsdp1_modules": fsdp1, "dtensor_params": dtensors,
            "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in modules),
            "model_class": type(model).__name__ if model is not None else None}


def _clean(name: str) -> str:
    name = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
    return name[len("module."):] if name.startswith("module.") else name  # DDP


def full_params(model) -> dict:
    """{clean name: (full tensor, requires_grad)} of every parameter, gathered from FSDP shards (a collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        from torch.distributed._tensor import DTensor

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {_clean(n): (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    return {_clean(n): ((p.full_tensor() if isinstance(p, DTensor) else p).detach().clone(), p.requires_grad)
            for n, p in model.named_parameters()}


def _midway_budget(model, version: int = 2, kept: bool = False) -> int:
    """Midway between the predicted peaks of no and full checkpointing for this rank under FSDP2 over 2 ranks: half
    the gradients, and the parameters FSDP2 gathers whole while a block or the head computes (from the whole model
    here: it is wrapped later, by the Trainer): two blocks, or the head and the last block; with tied embeddings,
    accelerate's group of the embeddings, the final norm and the head besides two blocks, whole from the start. Under
    FSDP1, the root unit (everything outside the blocks), which FSDP1 keeps whole, and two blocks. With no reshard
    after forward (`kept`: `shard_grad_op`), every unit stays whole until its backward: the whole model."""
    import dataclasses

    from trl_gc_plugin.core.layout import Layout
    from trl_gc_plugin.planning import memory, planner
    from trl_gc_plugin.planning.planner import gathered_bytes

    def size(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    est = memory.estimate(model, 2, 16)  # the Trainer's batch: 2 rows of the 16-token tokenized dataset
    whole = [size(b) for _, b in memory.named_blocks(model)]
    if kept:
        gathered = size(model)
    elif version == 1:
        outside = size(model) - sum(whole)
        gathered = outside + gathered_bytes(whole, 0)
    elif model.config.tie_word_embeddings:
        gathered = size(model.get_input_embeddings()) + size(model.model.norm) + gathered_bytes(whole, 0)
    else:
        gathered = gathered_bytes(whole, size(model.get_output_embeddings()))
    est = dataclasses.replace(est, gathered_bytes=gathered)
    n = est.num_blocks
    return sum(planner.predict_peak(est, Layout.from_pattern((on,) * n), grad_fraction=0.5)[0] for on in (False, True)) // 2


def run(out: str, scenario: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from trl_gc_plugin import SafeGCCallback, installed
    from trl_gc_plugin.model.ckpt import model_use_reentrant
    from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

    kind, model_kind, gc, ac, cache, plugin = scenario.split("-")
    _SHIM_ON["on"] = kind in ("v1", "v2", "v1g", "v2g")
    rank = int(os.environ.get("RANK", "0"))
    result: dict = {"scenario": scenario, "rank": rank}

    model = (make_model(attention_dropout=0.1) if model_kind == "dropout" else
             make_model(tie_word_embeddings=True) if model_kind == "tied" else
             make_model(num_hidden_layers=4) if model_kind == "deep" else make_model())
    model.config.use_cache = cache in ("1", "2")
    if model_kind == "frozenemb":
        model.get_input_embeddings().weight.requires_grad_(False)
    if model_kind in ("lora", "lorahook", "loradrop"):
        dropout = 0.1 if model_kind == "loradrop" else 0.0
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=dropout))
    if model_kind == "lorahook":
        model.enable_input_require_grads()
    before = {_clean(n): p.detach().clone() for n, p in model.named_parameters()}
    trainable = {_clean(n) for n, p in model.named_parameters() if p.requires_grad}
    first_layer = next(m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer")

    def first_input(module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if module.training and "layer0_input_requires_grad" not in result:
            result["layer0_input_requires_grad"] = bool(hidden.requires_grad)

    hook = first_layer.register_forward_pre_hook(first_input, with_kwargs=True)

    seen: dict = {}
    held_off: list = []

    class Look(TrainerCallback):
        def on_init_end(self, args, state, control, model=None, **kwargs):
            seen["init_end"] = fsdp_wrapping(model, args)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["train_begin"] = fsdp_wrapping(model, args)
            if plugin == "unshard":  # a user's callback that gathers every FSDP2 group before the first step
                from torch.distributed.fsdp import FSDPModule

                for module in model.modules():
                    if isinstance(module, FSDPModule):
                        module.unshard()
            if plugin == "budget":  # what FSDP really holds whole, against the plan's gathered-parameter term
                from held import fsdp1_whole, fsdp2_whole, watch

                seen["held"], remove = watch(model, fsdp1_whole if version == 1 else fsdp2_whole)
                held_off.append(remove)

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if "grads" in seen:
                return
            # what a gradient audit can read on this rank before the first optimizer step: layer parameters
            # without a .grad, and with a .grad whose local shard is all zero (FSDP2: DTensor.to_local())
            layer = [(n, p) for n, p in model.named_parameters() if p.requires_grad and ".layers." in n]
            local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for _, p in layer]
            seen["grads"] = {"layer_params": len(layer), "grad_none": sum(g is None for g in local),
                             "grad_zero": sum(g is not None and g.numel() > 0 and not bool(g.abs().sum()) for g in local),
                             "grad_empty": sum(g is not None and g.numel() == 0 for g in local)}

    version = 1 if kind in ("v1", "v1g", "ddp1") else 2
    fsdp_config = {"version": version, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    os.environ["FSDP_VERSION"] = str(version)  # transformers 4.x leaves the version to accelerate's environment
    if version == 1:
        fsdp_config["sync_module_states"] = False  # accelerate's sync needs an accelerator; the ranks start equal
    if kind == "v1g":  # accelerate 1.x's FSDP1 plugin takes its strategy from here, not from reshard_after_forward
        os.environ["FSDP_SHARDING_STRATEGY"] = "SHARD_GRAD_OP"
    if kind == "v2g":  # transformers 4.x passes no reshard_after_forward: accelerate reads it from here
        os.environ["FSDP_RESHARD_AFTER_FORWARD"] = "false"
    if ac == "1":
        fsdp_config["activation_checkpointing"] = True
    gc_kwargs = {}
    if gc != "off":
        reentrant = FLAG[gc]
        gc_kwargs = {"gradient_checkpointing": True,
                     "gradient_checkpointing_kwargs": None if reentrant is None else {"use_reentrant": reentrant}}
    callbacks = [Look()]
    if plugin in ("strict", "fix"):
        callbacks.append(SafeGCCallback(mode=plugin))
    if plugin in ("budget", "unshard"):  # strict, a budget midway between the predicted peaks of none and full
        callbacks.append(SafeGCCallback(mode="strict", memory_budget=_midway_budget(model, version, kind.endswith("g"))))
        result["block_bytes"] = sum(p.numel() * p.element_size() for p in first_layer.parameters())
        result["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    scope = contextlib.nullcontext()
    if plugin.startswith("installed"):
        scope = installed(mode="fix" if plugin == "installedfix" else "strict")
    trainer = None
    started = time.time()
    try:
        with scope:
            result["where"] = "TrainingArguments"
            args = TrainingArguments(
                output_dir=os.path.join(out, scenario), max_steps=1 if model_kind in ("dropout", "loradrop") else 2,
                per_device_train_batch_size=2, learning_rate=1e-2, use_cpu=True, ddp_backend="gloo",
                report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
                fsdp=f"{'shard_grad_op' if kind.endswith('g') else 'full_shard'} auto_wrap", fsdp_config=fsdp_config,
                **gc_kwargs,
                **({"use_cache": True} if cache == "2" else {}))
            result["where"] = "Trainer"
            trainer = Trainer(model=model, args=args, train_dataset=tokenized_dataset(make_tokenizer()),
                              callbacks=callbacks)
            result["is_fsdp_enabled"] = trainer.is_fsdp_enabled
            result["where"] = "train"
            trainer.train()
        result["outcome"] = "trained"
    except Exception as exc:  # reported, not raised: the test reads the outcome
        result["outcome"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        frames = traceback.extract_tb(exc.__traceback__)
        result["in_backward"] = any(f.name == "backward" for f in frames)
        result["raised_at"] = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:]]
    hook.remove()
    for remove in held_off:
        remove()
    result["seconds"] = round(time.time() - started, 2)
    result["seen"] = seen
    result["running"] = model_use_reentrant(model)
    result["use_cache"] = model.config.use_cache if hasattr(model, "config") else None
    if len(callbacks) > 1:
        result["decisions"] = [[d.rule_id, d.action] for d in callbacks[1].decisions]
        result["warnings"] = [d.reason for d in callbacks[1].decisions if d.level in ("warning", "error")]
        result["plans"] = [[d.after["plan"], d.after["estimate"]["grad_fraction"]] for d in callbacks[1].decisions
                           if d.rule_id == "memory-plan" and isinstance(d.after, dict) and "estimate" in d.after]
        result["gathered_predicted"] = [d.after["estimate"]["gathered_bytes"] for d in callbacks[1].decisions
                                        if d.rule_id == "memory-plan" and isinstance(d.after, dict)
                                        and "estimate" in d.after]
    if trainer is not None and result["outcome"] == "trained":
        result["wrapper"] = type(trainer.model_wrapped).__name__
        result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        gathered_params = full_params(trainer.model_wrapped)
        after = {n: t for n, (t, _) in gathered_params.items()}
        layers = [n for n in trainable if ".layers." in n]
        result["layer_params"] = len(layers)
        result["layer_params_changed"] = sum(n in after and not torch.equal(after[n], before[n]) for n in layers)
        result["frozen_changed"] = sorted(n for n in before if n not in trainable and n in after
                                          and not torch.equal(after[n], before[n]))
        result["missing_after"] = sorted(set(before) - set(after))[:5]
        after = {n: t for n, t in after.items() if n in trainable}
        total = torch.stack([t.double().sum() for t in after.values()]).sum().reshape(1)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, total)
        result["checksums"] = [float(g) for g in gathered]
        if rank == 0:
            torch.save({n: t for n, t in after.items()}, os.path.join(out, f"{scenario}.pt"))
    return result


def main() -> None:
    out, scenarios = sys.argv[1], sys.argv[2:]
    fsdp_on_cpu()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    write_results(out, scenarios, run)

if __name__ == "__main__":
    main()
