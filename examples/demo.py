"""`make demo`: a silent checkpointing failure of the installed transformers, without and with the plugin.

The same short SFT run (a tiny model built offline, CPU, seconds) three times: without checkpointing (the
reference), with checkpointing as the user asked and no plugin, and with `SafeGCCallback` (strict, then fix). What
differs is what the parameters learned in one step (plain SGD, so the update is the gradient).

- transformers 5.x: Gemma 4 shares KV states across layers; `use_reentrant=True` computes wrong gradients.
- transformers 4.x: frozen input embeddings and `use_reentrant=True` (Axolotl's default for plain SFT): the decoder
  layers get no gradient at all.

    python examples/demo.py [--output-dir DIR]
"""

# ruff: noqa: E402 (bitsandbytes' logger is quieted before the imports that load it)
from __future__ import annotations

import argparse
import logging
import tempfile
import warnings
from typing import Any

# bitsandbytes, imported by PEFT / transformers when installed (the test extras install it), logs at import that its
# optional CPU kernels package is missing; the demo quantizes nothing, so its first screen stays the plugin's
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

import datasets
import torch
import transformers
import trl
from packaging.version import Version
from trl import SFTConfig, SFTTrainer

from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.testing import lm_dataset, make_model, make_tokenizer

TF5 = Version(transformers.__version__) >= Version("5.0.0")


def build_model() -> Any:
    """The model of the scenario, seeded: every run starts from the same weights."""
    if not TF5:
        model = make_model()
        model.get_input_embeddings().weight.requires_grad_(False)
        return model
    config = transformers.Gemma4TextConfig(
        vocab_size=len(make_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_kv_shared_layers=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def train(output_dir: str, checkpointing: bool, callback: SafeGCCallback | None) -> dict[str, torch.Tensor]:
    """One SFT step; the change of every parameter."""
    model = build_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SFTConfig(
        output_dir=output_dir, max_steps=1, per_device_train_batch_size=4, learning_rate=1.0, optim="sgd",
        max_length=32, gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": True},
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=lm_dataset(16), processing_class=make_tokenizer(),
                         callbacks=[callback] if callback else None)
    trainer.remove_callback(transformers.PrinterCallback)  # the demo prints its own lines
    trainer.train()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def compare(updates: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> str:
    layers = [n for n in reference if ".layers." in n and reference[n].abs().max() > 0]
    dead = [n for n in layers if updates[n].abs().max() == 0]
    if dead:
        return f"{len(layers) - len(dead)} of {len(layers)} layer parameters trained"
    worst = max(float((updates[n] - reference[n]).abs().max() / reference[n].abs().max()) for n in layers)
    return "updates equal to no checkpointing" if worst == 0 else f"updates off by up to {worst:.0%} (wrong gradients)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=None)
    ns = parser.parse_args()
    out = ns.output_dir or tempfile.mkdtemp(prefix="trl-gc-demo-")
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    logging.getLogger("trl_gc_plugin").setLevel(logging.CRITICAL)  # the demo prints its own summary

    what = ("Gemma 4 (4 layers sharing KV states across layers)" if TF5
            else "Llama (2 layers) with frozen input embeddings")
    print(f"trl-gc-plugin demo: transformers {transformers.__version__}, TRL {trl.__version__}, CPU")
    print(f"SFT, one step: {what}, gradient_checkpointing_kwargs={{'use_reentrant': True}}")
    reference = train(f"{out}/reference", checkpointing=False, callback=None)
    print(f"  without the plugin:     trains without an error; {compare(train(f'{out}/bare', True, None), reference)}")
    try:
        train(f"{out}/strict", True, SafeGCCallback())
        print("  with the plugin, strict: trained (nothing to refuse)")
    except GCConfigError as err:
        rule = err.decisions[0].rule_id
        print(f"  with the plugin, strict: refused before any update: [{rule}] (what to change is in the message)")
    fix = SafeGCCallback(mode="fix")
    fixed = compare(train(f"{out}/fix", True, fix), reference)
    changed = [d for d in fix.decisions if d.action in ("override", "repair") and d.setting == "use_reentrant"]
    how = f"use_reentrant -> {changed[0].after} [{changed[0].rule_id}]" if changed else "nothing changed"
    print(f"  with the plugin, fix:    {how}; {fixed}")
    print(f"Decisions of the fix run: {out}/fix/gc_decisions.json; every rule: python -m trl_gc_plugin rules")


if __name__ == "__main__":
    main()
