"""Parse configs with the launchers' own code, in a clean process started by `native.py`: `{"jobs": [...]}` on stdin,
one JSON line per job on stdout, flushed as each finishes (a parent that stops waiting keeps those). TRL: what `trl
<command>` runs (`--use_cpu` lets TRL's `bf16=True` default pass without a GPU), then `probe.facts_from_args`; keys
TRL hands to `accelerate launch` are checked by accelerate's own parser. LLaMA-Factory: its `read_args` and
`get_train_args` / `get_infer_args`, without the `deepspeed` key (refused outside a distributed launch).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import sys
from typing import Any

FACT_FIELDS = (
    "gc_enabled",
    "use_reentrant",
    "kwargs_given",
    "zero_stage",
    "fsdp",
    "fsdp_activation_checkpointing",
    "ddp_find_unused_parameters",
    "ddp_static_graph",
    "fsdp_version",
    "zero_overlap_comm",
)

ENVIRONMENT = re.compile(
    r"GPU|CUDA|cuda|Ampere|NPU|XPU|MPS|\bmps\b|bf16|fp16|tf32|not installed|pip install|is not available|"
    r"requires? .* (installed|library)|Output directory|No such file|device|Expected a string path to an existing",
)
"""Failures of the machine the check runs on, not of the config: the parse falls back to the model."""


def _classify(exc: BaseException) -> str:
    if isinstance(exc, (ImportError, OSError, RuntimeError, MemoryError)):
        return "environment"
    if isinstance(exc, (ValueError, TypeError, AssertionError, KeyError, AttributeError)):
        return "environment" if ENVIRONMENT.search(str(exc)) else "refused"
    return "environment"


TRL0_COMMANDS = ("dpo", "grpo", "kto", "reward", "rloo", "sft")
"""The training commands of TRL 0.x's CLI (`trl/cli.py`, one module; TRL 1.x lists them in `trl.cli.commands`)."""


def _check_accelerate_config(value: str) -> None:
    """Refuse, as `trl <command>` does, an `--accelerate_config` that is neither a file nor a config TRL ships."""
    try:
        from trl.cli.accelerate_config import resolve_accelerate_config_argument
    except ImportError:  # TRL 0.x resolves it inside trl/cli.py's main()
        from trl_gc_plugin.configcheck.read.accelerate import trl_bundled

        if not os.path.isfile(value) and trl_bundled(value) is None:
            raise ValueError(
                f"Accelerate config {value} is neither a file nor a valid config in the `trl` package."
            ) from None
    else:
        resolve_accelerate_config_argument(["--accelerate_config", value])


def _trl(job: dict[str, Any]) -> dict[str, Any]:
    import inspect

    import trl

    from trl_gc_plugin.model.probe import facts_from_args

    module = importlib.import_module(f"trl.scripts.{job['trainer']}")
    parser = module.make_parser()
    argv = ["--config", job["path"], "--use_cpu", "true"]
    if "separate_remaining_strings" in inspect.signature(parser.parse_args_and_config).parameters:  # TRL >= 1.0
        out = parser.parse_args_and_config(argv, return_remaining_strings=True, separate_remaining_strings=True)
        remaining = out[-2]  # the config's keys no dataclass took (the command line's are out[-1])
    else:  # TRL 0.x: one list; the command line here has nothing left over
        out = parser.parse_args_and_config(argv, return_remaining_strings=True)
        remaining = out[-1]
    args, model_args = out[1], out[2]
    facts = facts_from_args(args, stage="post_init")  # the arguments alone: no Trainer, no model yet
    keys = [remaining[i][2:] for i in range(0, len(remaining), 2)]
    unknown: list[str] = []
    valueless: list[str] = []
    if keys:
        from accelerate.commands.launch import launch_command_parser

        launch = launch_command_parser()
        options = {o.lstrip("-").replace("-", "_"): a for a in launch._actions for o in a.option_strings}
        for key in keys:
            if key == "accelerate_config":
                _check_accelerate_config(remaining[remaining.index("--accelerate_config") + 1])
            elif key not in options:
                unknown.append(key)
            elif options[key].nargs == 0:
                valueless.append(key)
    return {
        "version": trl.__version__,
        "facts": {name: getattr(facts, name) for name in FACT_FIELDS if hasattr(facts, name)},
        "use_peft": bool(model_args.use_peft),
        "load_in_4bit": bool(model_args.load_in_4bit),
        "load_in_8bit": bool(model_args.load_in_8bit),
        "unknown_keys": unknown,
        "known_by": {key: _commands_with_field(key) for key in unknown},
        "valueless_keys": valueless,
    }


_FIELDS: dict[str, set[str]] = {}


def _commands_with_field(key: str) -> list[str]:
    try:
        from trl.cli.commands import get_commands
    except ImportError:  # TRL 0.x
        commands = list(TRL0_COMMANDS)
    else:
        commands = [c.name for c in get_commands() if type(c).__name__ == "TrainingCommand"]
    for name in commands:
        if name not in _FIELDS:
            try:
                parser = importlib.import_module(f"trl.scripts.{name}").make_parser()
                _FIELDS[name] = {action.dest for action in parser._actions}
            except Exception:
                _FIELDS[name] = set()
    return [name for name in commands if key in _FIELDS[name]]


LLAMAFACTORY_FIELDS = {
    "model": (
        "disable_gradient_checkpointing",
        "use_reentrant_gc",
        "use_unsloth_gc",
        "use_unsloth",
        "use_kt",
        "quantization_bit",
        "quantization_method",
        "adapter_name_or_path",
    ),
    "training": (
        "do_train",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "ddp_find_unused_parameters",
        "ddp_static_graph",
        "fsdp",
        "fsdp_config",
    ),
    "finetuning": ("stage", "finetuning_type"),
}


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)  # an enum's
    return value if value is None or isinstance(value, (bool, int, float, str, list, dict)) else str(value)


def _llamafactory(job: dict[str, Any]) -> dict[str, Any]:
    os.environ["DISABLE_VERSION_CHECK"] = "1"
    import llamafactory
    from llamafactory.hparams import get_infer_args, get_train_args
    from llamafactory.hparams.parser import read_args

    saved_argv = sys.argv
    sys.argv = ["llamafactory-cli", job["path"]]
    try:
        values = read_args()
    finally:
        sys.argv = saved_argv
    if not isinstance(values, dict):
        raise ValueError("LLaMA-Factory read no mapping from the file")
    values.pop("deepspeed", None)
    if job["training"]:
        values["use_cpu"] = True
        model_args, _data, training_args, finetuning_args, _gen = get_train_args(values)
    else:
        model_args, _data, finetuning_args, _gen = get_infer_args(values)
        training_args = None
    parsed = {"model": model_args, "training": training_args, "finetuning": finetuning_args}
    found = {
        name: _plain(getattr(parsed[group], name))
        for group, names in LLAMAFACTORY_FIELDS.items()
        for name in names
        if hasattr(parsed[group], name)  # False for the training arguments of a non-training config (None)
    }
    return {"version": getattr(llamafactory, "__version__", "unknown"), "values": found}


def run(job: dict[str, Any]) -> dict[str, Any]:
    """One job, never raising: `{"id", "ok": True, ...}` or `{"id", "ok": False, "kind", "message"}`."""
    saved = dict(os.environ)  # TRL applies a config's `env:`
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            out = _trl(job) if job["launcher"] == "trl" else _llamafactory(job)
        return {"id": job["id"], "ok": True, **out}
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        message = (lines[-1] if lines else "the parser exited").split(": error: ", 1)[-1]
        return {"id": job["id"], "ok": False, "kind": "usage", "message": message}
    except BaseException as exc:  # the launcher's own code: anything may come out of it
        return {"id": job["id"], "ok": False, "kind": _classify(exc), "message": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> int:
    import yaml

    if hasattr(yaml, "CSafeLoader"):  # libyaml for the launchers' safe_load: same YAML, a large file in seconds
        c_loader = yaml.CSafeLoader
        yaml.safe_load = lambda stream: yaml.load(stream, Loader=c_loader)  # type: ignore[assignment]
    real_stdout = sys.stdout
    for job in json.load(sys.stdin)["jobs"]:
        real_stdout.write(json.dumps(run(job), default=repr) + "\n")
        real_stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
