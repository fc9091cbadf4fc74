"""flex_attention under gradient checkpointing, without the plugin: does either `use_reentrant` value fail?

Axolotl forces `use_reentrant: true` for flex attention (a BlockMask metadata `CheckpointError` with non-reentrant
checkpointing is the reason given), the opposite of the plugin's default. flex attention has no CPU backward in torch
2.13, so this runs on CUDA only: a tiny Llama with `attn_implementation="flex_attention"`, one forward/backward per
setting (no checkpointing, reentrant, non-reentrant; full fine-tune and frozen embeddings), and the largest relative
gradient difference against no checkpointing. Prints one JSON object; writes it with `--out`.

Run: `python benchmarks/flex_attention_gc.py --out benchmarks/results/flex_attention_gc.json` (a GPU machine).
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path


def one(setting: str, frozen: bool) -> dict[str, object]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, use_cache=False)
    model = LlamaForCausalLM._from_config(config, attn_implementation="flex_attention").to("cuda", torch.bfloat16)
    model.train()
    if frozen:
        model.get_input_embeddings().weight.requires_grad_(False)
    if setting != "off":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": setting == "reentrant"})
        if frozen and setting == "reentrant":
            model.enable_input_require_grads()
    ids = torch.randint(0, 256, (2, 256), device="cuda")
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                "where": traceback.extract_tb(exc.__traceback__)[-1].filename.split("site-packages/")[-1]}
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    ns = parser.parse_args()
    import torch
    import transformers

    result: dict[str, object] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if not torch.cuda.is_available():
        result["skipped"] = "no CUDA device"
    else:
        for frozen in (False, True):
            ref = one("off", frozen)
            for setting in ("reentrant", "non-reentrant"):
                run = one(setting, frozen)
                key = f"{'frozen_embeddings' if frozen else 'full'}/{setting}"
                if "error" in run or "error" in ref:
                    result[key] = {k: v for k, v in run.items() if k != "grads"} or ref
                    continue
                a, b = run["grads"], ref["grads"]
                missing = sorted(set(b) - set(a))
                rel = max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)).item() for n in b if n in a)
                result[key] = {"max_rel_diff": round(rel, 5), "missing": len(missing), "compared": len(b)}
    text = json.dumps(result, indent=2)
    print(text)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
