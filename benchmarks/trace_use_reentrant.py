"""Trace the default `use_reentrant` of a `TRL_GC_PLUGIN=1` Trainer run, from the `.pth` to the arguments.

Runs, in a child process with `TRL_GC_PLUGIN=1` (so the `.pth` line imports `trl_gc_plugin._startup` at start-up):
`TrainingArguments(gradient_checkpointing=True)` without checkpointing kwargs, then a `Trainer` on a tiny Llama,
under `sys.setprofile`. It prints whether the start-up hook ran from the `.pth`, the plugin's modules in the order
they first ran, and the call stack (plugin and transformers frames) at the moment `use_reentrant` first appears in
the arguments' checkpointing kwargs: the module that decides it and the one that writes it. Issue 45 asks that a
newcomer follow this path in at most 6 modules; the output says how many it takes today (the decision's path: the
start-up hook, the modules on the stack that writes it, the modules whose `use_reentrant` functions ran before).

    TRL_GC_PLUGIN is set for the child; run with the interpreter whose site-packages hold the plugin's `.pth`:
    python benchmarks/trace_use_reentrant.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys, tempfile

started = "trl_gc_plugin._startup" in sys.modules
import trl_gc_plugin

PACKAGE = os.path.dirname(trl_gc_plugin.__file__) + os.sep
TRANSFORMERS = None
order, seen, found = [], set(), {}


def module_of(filename):
    rel = filename[len(PACKAGE):-3].replace(os.sep, ".")
    return "trl_gc_plugin." + rel.removesuffix(".__init__")


def kwargs_of(args):
    out = {}
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        value = args.__dict__.get(name)
        if isinstance(value, dict):
            out[name] = dict(value)
    return out


def stack(frame):
    frames = []
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            frames.append(f"{module_of(name)}:{frame.f_code.co_qualname}")
        elif f"{os.sep}transformers{os.sep}" in name:
            rel = name.split(f"{os.sep}transformers{os.sep}", 1)[1][:-3].replace(os.sep, ".")
            frames.append(f"transformers.{rel}:{frame.f_code.co_qualname}")
        frame = frame.f_back
    return frames[::-1]


def profile(frame, event, arg):
    filename = frame.f_code.co_filename
    if not filename.startswith(PACKAGE):
        return
    if event == "call":
        key = (module_of(filename), frame.f_code.co_qualname)
        if key not in seen:
            seen.add(key)
            order.append(key)
    elif event == "return" and not found:
        ta = sys.modules.get("transformers.training_args")
        if ta is None:
            return
        for value in list(frame.f_locals.values()):
            if isinstance(value, ta.TrainingArguments):
                kwargs = kwargs_of(value)
                if any("use_reentrant" in k for k in kwargs.values()):
                    found.update(
                        writer=f"{module_of(filename)}:{frame.f_code.co_qualname}",
                        stack=stack(frame),
                        kwargs=kwargs,
                        modules_before=sorted({m for m, _ in order}),
                        reentrant_calls=[f"{m}:{q}" for m, q in order if "reentrant" in q.lower() and "<" not in q],
                    )
                    return


import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2)
model = LlamaForCausalLM(config)
data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]] * 4, "labels": [[1, 2, 3, 4]] * 4})
sys.setprofile(profile)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, gradient_checkpointing=True, report_to=[], use_cpu=True, max_steps=1)
    after_args = kwargs_of(args)
    trainer = Trainer(model=model, args=args, train_dataset=data)
sys.setprofile(None)
modules = []
for module, _ in order:
    if module not in modules:
        modules.append(module)
print(json.dumps({"startup_from_pth": started, "after_training_arguments": after_args,
                  "after_trainer_init": kwargs_of(args), "modules_in_order": modules, "write": found}))
"""


def trace() -> dict:
    env = dict(os.environ, TRL_GC_PLUGIN="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the traced run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(result: dict) -> str:
    write = result["write"]
    lines = [
        f"- `.pth` -> `trl_gc_plugin._startup` at interpreter start-up: {result['startup_from_pth']}",
        f"- the arguments' checkpointing kwargs after `TrainingArguments(...)`: {result['after_training_arguments']}",
        f"- after `Trainer(...)`: {result['after_trainer_init']}",
    ]
    if write:
        plugin = [f for f in write["stack"] if f.startswith("trl_gc_plugin.")]
        modules = list(dict.fromkeys(f.split(":")[0] for f in plugin))
        lines += [
            f"- first written by `{write['writer']}`; the call stack at that moment (outermost first):",
            *[f"  - `{frame}`" for frame in write["stack"]],
            f"- plugin modules on that stack: {len(modules)}; plugin modules that had run before it: "
            f"{len(write['modules_before'])} ({', '.join(f'`{m}`' for m in write['modules_before'])})",
            f"- functions named for `use_reentrant` that had run before it: "
            f"{', '.join(f'`{c}`' for c in write['reentrant_calls'])}",
        ]
        path = (["trl_gc_plugin._startup"] if result["startup_from_pth"] else []) + modules
        path += [c.split(":")[0] for c in write["reentrant_calls"]]
        path = list(dict.fromkeys(path))
        lines.append(
            f"- the decision's path, the modules a reader opens to follow it (the start-up hook, the modules on the "
            f"writing stack, the modules whose functions for `use_reentrant` ran): {len(path)} "
            f"({' -> '.join(f'`{m}`' for m in path)})"
        )
    else:
        lines.append("- `use_reentrant` never appeared in the arguments' checkpointing kwargs")
    lines.append(
        f"- plugin modules that ran in all, in order: {', '.join(f'`{m}`' for m in result['modules_in_order'])}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the trace as JSON")
    result = trace()
    print(json.dumps(result, indent=2) if parser.parse_args().json else render(result))


if __name__ == "__main__":
    main()
