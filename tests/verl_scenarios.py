"""Run under `torchrun --nproc_per_node 2`: verl's FSDP engine call order on a tiny Llama (gloo, CPU), no Trainer.

    torchrun --nproc_per_node 2 tests/verl_scenarios.py OUTDIR SCENARIO [SCENARIO ...]

What `verl/workers/engine/fsdp/transformer_impl.py` (verl 1dda039, `_build_module` and `_build_lora_module`) does,
emulated with the real transformers, PEFT and torch FSDP2 (`fully_shard` per decoder layer, then the root, as
`apply_fsdp2` does): `gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`; for
LoRA `enable_input_require_grads()` then `get_peft_model`; FSDP2; two AdamW steps with `use_cache=False`.

A scenario is `<model>-<path>`: model `full`, `lora` or `moe` (a tiny Qwen3-MoE, fully trained, its load-balancing
loss on); path `engine` (the calls above) or `offload` (what verl's
activation offloader adds after the wrapping, `verl/utils/activation_offload.py`: `gradient_checkpointing_disable()` on
every module, then each decoder layer's forward wrapped in `torch.utils.checkpoint(..., use_reentrant=True)` with
its keyword arguments flattened into positional inputs; the CPU offloading itself is not emulated). Whether the
plugin runs is the launch's `TRL_GC_PLUGIN`. Each rank appends one JSON line: the outcome, how many trainable tensors
changed, a checksum of the trainable parameters (gathered from the shards), and the plugin's log lines.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.distributed as dist
from torchrun import write_results

from trl_gc_plugin.testing import make_model


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def own_reentrant_checkpoint(layer) -> None:
    """verl's `ActivationHandler._ckpt_forward` shape: the layer's forward replaced on the instance by one that runs
    the original under `torch.utils.checkpoint.checkpoint(use_reentrant=True)`, keywords passed positionally."""
    original = layer.forward

    def forward(*args, **kwargs):
        keys = tuple(kwargs)

        def run(*inputs):
            positional = inputs[: len(inputs) - len(keys)]
            return original(*positional, **dict(zip(keys, inputs[len(positional) :], strict=True)))

        return torch.utils.checkpoint.checkpoint(run, *args, *kwargs.values(), use_reentrant=True)

    layer.forward = forward


def tiny_moe():
    """A tiny Qwen3-MoE built offline, its load-balancing loss on (the router trains from it)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.1, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _patched() -> bool:
    """The model route is installed: `PreTrainedModel`'s enable method is the plugin's."""
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel.gradient_checkpointing_enable, "original")


def _full(param) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def run(out: str, scenario: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    kind, path = scenario.split("-")
    lines = _Lines()
    plugin_logger = logging.getLogger("trl_gc_plugin")
    plugin_logger.addHandler(lines)
    plugin_logger.setLevel(logging.INFO)
    result: dict = {"scenario": scenario, "rank": dist.get_rank(), "plugin": _patched()}
    model = tiny_moe() if kind == "moe" else make_model()
    try:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if kind == "lora":
            from peft import LoraConfig, get_peft_model

            model.enable_input_require_grads()
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        layers = model.get_base_model().model.layers if kind == "lora" else model.model.layers
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        if path == "offload":
            for module in model.modules():
                if hasattr(module, "gradient_checkpointing_disable"):
                    module.gradient_checkpointing_disable()
            for layer in layers:
                own_reentrant_checkpoint(layer)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        before = {n: _full(p).detach().clone() for n, p in trainable}
        opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
        model.train()
        for step in range(2):
            ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad()
        result["outcome"] = "trained"
        after = {n: _full(p).detach() for n, p in trainable}
        result["changed"] = sum(1 for n in after if not torch.equal(after[n], before[n]))
        result["trainable"] = len(after)
        result["checksum"] = float(sum(t.double().sum() for t in after.values()))
    except Exception as exc:  # the outcome is the result
        result["outcome"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    logging.getLogger("trl_gc_plugin").removeHandler(lines)
    result["log"] = lines.lines
    return result


def main() -> None:
    out, scenarios = sys.argv[1], sys.argv[2:]
    write_results(out, scenarios, run)


if __name__ == "__main__":
    main()
