"""What the checkpointing modes cost: step time and peak memory, no checkpointing vs reentrant vs non-reentrant,
full fine-tune and LoRA, on a Llama-shaped model large enough that activations dominate.

Each configuration runs in its own process (peak memory is per process): CPU peak = the process's max RSS
(`ru_maxrss`, model and optimizer included; the RSS after building the model is reported beside it), CUDA peak =
`torch.cuda.max_memory_allocated`. One warm-up step, then `--steps` measured steps (forward + backward + AdamW
step); `--rounds` rounds interleave the configurations so drift hits them alike.

    .venv/bin/python benchmarks/modes.py [--rounds 2] [--steps 5] [--hidden 512 --layers 8 --seq 512 --batch 4]

Writes benchmarks/results/modes.json, modes.csv and (with matplotlib) modes.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"none": None, "reentrant": True, "non_reentrant": False}
FINETUNES = ("full", "lora")
RESULTS = Path(__file__).parent / "results"


def worker(ns: argparse.Namespace) -> None:
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=ns.hidden, intermediate_size=ns.hidden * 8 // 3, num_hidden_layers=ns.layers,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=8000,
                         max_position_embeddings=ns.seq, use_cache=False)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = LlamaForCausalLM(config).to(device)
    if ns.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    reentrant = MODES[ns.mode]
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if reentrant:
            model.enable_input_require_grads()  # what PEFT/TRL do; without it LoRA layers would get no gradient
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(config.vocab_size, (ns.batch, ns.seq), device=device)
    rss_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step() -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up
    times = [step() for _ in range(ns.steps)]
    result = {
        "finetune": ns.finetune, "mode": ns.mode, "device": device.type, "threads": torch.get_num_threads(),
        "step_s": times, "median_step_s": statistics.median(times),
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_after_model_bytes": rss_model,
    }
    Path(ns.json_out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rescore", action="store_true", help="recompute ratios and plot from results/modes.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--finetune", choices=FINETUNES, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns)
        return
    if ns.rescore:
        rescore()
        return

    shape = ["--hidden", str(ns.hidden), "--layers", str(ns.layers), "--seq", str(ns.seq), "--batch", str(ns.batch),
             "--steps", str(ns.steps)]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.rounds):
            for finetune in FINETUNES:
                for mode in MODES:
                    out = os.path.join(tmp, f"{r}-{finetune}-{mode}.json")
                    subprocess.run([sys.executable, __file__, "--worker", "--finetune", finetune, "--mode", mode,
                                    "--json-out", out, *shape], check=True)
                    run = json.loads(Path(out).read_text())
                    run["round"] = r
                    runs.append(run)
                    print(f"round {r} {finetune:4} {mode:13} median step {run['median_step_s']:.3f} s, "
                          f"peak {run['peak_bytes'] / 2**30:.2f} GiB", flush=True)

    summary: dict[str, dict] = {}
    for finetune in FINETUNES:
        for mode in MODES:
            mine = [x for x in runs if x["finetune"] == finetune and x["mode"] == mode]
            summary[f"{finetune}/{mode}"] = {
                "median_step_s": statistics.median(x["median_step_s"] for x in mine),
                "per_round_median_step_s": [round(x["median_step_s"], 4) for x in mine],
                "peak_gib": statistics.median(x["peak_bytes"] for x in mine) / 2**30,
                "per_round_peak_gib": [round(x["peak_bytes"] / 2**30, 3) for x in mine],
                "rss_after_model_gib": statistics.median(x["rss_after_model_bytes"] for x in mine) / 2**30,
            }
    ratios = compute_ratios(summary)
    import torch
    import transformers

    result = {
        "shape": {"hidden": ns.hidden, "layers": ns.layers, "seq": ns.seq, "batch": ns.batch, "steps": ns.steps,
                  "rounds": ns.rounds},
        "device": runs[0]["device"], "threads": runs[0]["threads"], "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "summary": summary, "ratios": ratios,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "modes.json").write_text(json.dumps(result, indent=2) + "\n")
    with open(RESULTS / "modes.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["round", "finetune", "mode", "device", "median_step_s", "peak_gib", "rss_after_model_gib"])
        for x in runs:
            writer.writerow([x["round"], x["finetune"], x["mode"], x["device"], round(x["median_step_s"], 4),
                             round(x["peak_bytes"] / 2**30, 4), round(x["rss_after_model_bytes"] / 2**30, 4)])
    plot(summary, result)
    print(json.dumps({"ratios": ratios}, indent=2))


def compute_ratios(summary: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Checkpointing vs none and non-reentrant vs reentrant; memory both as whole-process peak and as the part above
    the RSS right after building the model (activations, gradients, optimizer state: what checkpointing acts on)."""
    ratios = {}
    for finetune in FINETUNES:
        none, re, nre = (summary[f"{finetune}/{m}"] for m in MODES)

        def above(x: dict) -> float:
            return x["peak_gib"] - x["rss_after_model_gib"]

        ratios[finetune] = {
            "memory_saving_reentrant_vs_none": round(1 - re["peak_gib"] / none["peak_gib"], 4),
            "memory_saving_non_reentrant_vs_none": round(1 - nre["peak_gib"] / none["peak_gib"], 4),
            "memory_saving_above_model_reentrant_vs_none": round(1 - above(re) / above(none), 4),
            "memory_saving_above_model_non_reentrant_vs_none": round(1 - above(nre) / above(none), 4),
            "time_cost_reentrant_vs_none": round(re["median_step_s"] / none["median_step_s"] - 1, 4),
            "time_cost_non_reentrant_vs_none": round(nre["median_step_s"] / none["median_step_s"] - 1, 4),
            "time_non_reentrant_over_reentrant": round(nre["median_step_s"] / re["median_step_s"], 4),
            "memory_non_reentrant_over_reentrant": round(nre["peak_gib"] / re["peak_gib"], 4),
        }
    return ratios


def rescore() -> None:
    """Recompute the ratios and the plot from an existing results/modes.json (no new measurement)."""
    result = json.loads((RESULTS / "modes.json").read_text())
    result["ratios"] = compute_ratios(result["summary"])
    (RESULTS / "modes.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result["summary"], result)
    print(json.dumps({"ratios": result["ratios"]}, indent=2))


def plot(summary: dict[str, dict], result: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"none": "o", "reentrant": "s", "non_reentrant": "^"}
    colors = {"full": "tab:blue", "lora": "tab:orange"}
    for key, value in summary.items():
        finetune, mode = key.split("/")
        ax.scatter(value["median_step_s"], value["peak_gib"], marker=markers[mode], color=colors[finetune], s=70,
                   label=f"{finetune}, {mode.replace('_', '-')}")
    shape = result["shape"]
    ax.set_xlabel("median step time (s)")
    ax.set_ylabel("peak memory (GiB, " + ("max RSS" if result["device"] == "cpu" else "max allocated") + ")")
    ax.set_title(f"Llama hidden {shape['hidden']}, {shape['layers']} layers, seq {shape['seq']}, batch {shape['batch']}"
                 f" ({result['device']}, {result['threads']} threads)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "modes.png", dpi=110)


if __name__ == "__main__":
    main()
