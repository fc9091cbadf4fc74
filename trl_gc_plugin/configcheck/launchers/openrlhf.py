"""OpenRLHF command lines (`deepspeed --module openrlhf.cli.train_sft ...`) in a shell script or text file, expanded
statically (`shell.commands`): the plugin's model of OpenRLHF 0.11.2 (and <= 0.9's flat flags). It refuses nothing
about checkpointing itself (no launcher rules); a flag the rules read that the expansion cannot, makes it `incomplete`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..read import shell
from ..read.common import Config, ConfigError, Context, Fact, NotTrainingConfig, Reading, Reentrant
from ..read.model_config import read_model_facts
from .base import Launcher
from .schema import Key, Step, Values, read_keys, rewrite

VERSION_MODELLED = "OpenRLHF 0.11.2 (and the flat flags of <= 0.9)"
SRC = "https://github.com/OpenRLHF/OpenRLHF/blob/v0.11.2/openrlhf/"
SOURCES = {
    "enable": SRC + "cli/train_sft.py#L39-L43 (gradient_checkpointing_kwargs={'use_reentrant': <flag>})",
    "critic": SRC + "trainer/ray/ppo_critic.py#L221-L224 (the critic uses the actor's flags)",
    "lora": SRC + "models/actor.py#L177-L189 (enable_input_require_grads, then get_peft_model)",
    "zero": SRC + "cli/train_sft.py#L178 (--ds.zero_stage, default 2)",
}
ENTRY = "openrlhf_entry"
"""The pseudo-key of the command's entry point (`train_sft`, ...)."""
UNREAD = "openrlhf_unread"
"""The pseudo-key of what the expansion left unread: `{"values": {flag: [what]}, "hidden": [...], "launch": [...]}`."""
MARKERS = frozenset({ENTRY})
STRONG_MARKERS = MARKERS
READ_KEYS = frozenset({ENTRY})  # a command line is parsed whole (`parse_command`)

KINDS = {
    "train_sft": "sft",
    "train_dpo": "dpo",
    "train_rm": "reward",
    "train_kto": "kto",
    "train_prm": "prm",
    "train_kd": "gkd",
    "train_ppo_ray": "ppo",
    "train_ppo": "ppo",
    "train_remote_rm": "reward",
}
RL = frozenset({"dpo", "kto", "ppo"})
GENERATING = frozenset({"ppo"})

_ENTRY_TOKEN = re.compile(r"^openrlhf\.cli\.([A-Za-z_][A-Za-z0-9_]*)$")
_END = frozenset({"&&", "||", ";", "|", "EOF", "&"})
_REDIRECT = re.compile(r"^(?:\d*[<>]|&>)")  # `> log`, `2>&1`: the command's words end there


def parse_command(path: str, text: str) -> Config:
    """The flags of the OpenRLHF command in `text`: `--a.b 3` -> `{"a.b": "3"}`, a bare flag -> True; `ENTRY`,
    `UNREAD`, and `openrlhf_nproc` when the launcher before it says the process count."""
    try:
        found, missing = shell.commands(text, "openrlhf.cli.", os.path.dirname(os.path.abspath(path)))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    runs = [(e, [(i, m.group(1)) for i, t in enumerate(e.words) if (m := _ENTRY_TOKEN.match(t))]) for e in found]
    runs = [(e, entries) for e, entries in runs if entries]
    if not runs:
        sourced = f"; it sources {', '.join(missing)}, not found here: check it where it is" if missing else ""
        raise (ConfigError if missing else NotTrainingConfig)(
            f"{path}: no OpenRLHF entry point (`openrlhf.cli.train_*`) in any command of the script (read as bash "
            f"would expand it: variables, arrays, heredocs, `bash -c` payloads, sourced files){sourced}"
        )
    names = sorted({name for _, entries in runs for _, name in entries})
    if len(names) > 1:
        raise ConfigError(f"{path}: several OpenRLHF commands ({', '.join(names)}); check one command per file")
    expanded, entries = runs[0]
    others = sum(
        1 for e, _ in runs[1:] if [shell.readable(w) for w in e.words] != [shell.readable(w) for w in expanded.words]
    )
    tokens = expanded.words
    start, entry = entries[0]
    values: dict[str, Any] = {ENTRY: entry}
    unread_values: dict[str, list[str]] = {}
    hidden: list[str] = []
    i = start + 1
    while i < len(tokens) and tokens[i] not in _END and not _REDIRECT.match(tokens[i]):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):  # `$EXTRA_ARGS` alone: unquoted, bash splits it into words (flags)
            hidden += expanded.what(token)
            continue
        name, eq, inline = token[2:].partition("=")
        hidden += expanded.what(name)  # `--${PREFIX}flag`: which flag is not known
        following = [] if eq else _values_after(tokens, i, expanded)
        values[name] = inline if eq else (following[0] if len(following) == 1 else following or True)
        unread = [what for word in ([inline] if eq else following) for what in expanded.what(word)]
        if unread:
            unread_values[name] = unread
        i += len(following)
    if others:
        hidden.append(
            f"{others} other command(s) run {entry} with other flags (branches of the script?); the first was read"
        )
    nproc, launch_unread = _launcher_processes(tokens, expanded)
    if nproc is not None:
        values["openrlhf_nproc"] = nproc
    values[UNREAD] = {"values": unread_values, "hidden": hidden, "launch": launch_unread}
    return Config(path=path, values=values, keys=tuple(values), kind="command")


def _values_after(tokens: list[str], i: int, expanded: shell.Expanded) -> list[str]:
    out: list[str] = []
    while i < len(tokens) and not tokens[i].startswith("--") and tokens[i] not in _END:
        if expanded.hides_words(tokens[i], after_a_value=bool(out)) or _REDIRECT.match(tokens[i]):
            break
        out.append(tokens[i])
        i += 1
    return out


def _launcher_processes(tokens: list[str], expanded: shell.Expanded) -> tuple[int | None, list[str]]:
    """Processes per launch from `deepspeed --num_gpus N [--num_nodes M]` or `torchrun --nproc_per_node N
    [--nnodes M]`, and what of those numbers could not be read."""
    unread: list[str] = []

    def number(flag: str) -> int | None:
        for t, following in zip(tokens, [*tokens[1:], None], strict=True):
            value = t[len(flag) + 1 :] if t.startswith(flag + "=") else following if t == flag else None
            if value is not None and expanded.what(value):
                unread.extend(f"{flag} {what}" for what in expanded.what(value))
                return None
            if value is not None and value.isdigit():
                return int(value)
        return None

    if any(t.endswith("deepspeed") for t in tokens):
        gpus = number("--num_gpus")
        return (None if gpus is None else gpus * (number("--num_nodes") or 1)), unread
    if any(t.endswith("torchrun") or t == "torch.distributed.run" for t in tokens):
        per_node = number("--nproc_per_node")
        return (None if per_node is None else per_node * (number("--nnodes") or 1)), unread
    return None, unread


def _switch(config: Config, name: str, value: Any) -> bool:
    if value is True or (isinstance(value, str) and value.lower() in ("true", "1")):
        return True
    raise ConfigError(f"{config.path}: --{name} is a switch (store_true) and takes no value, got {value!r}")


def _whole(config: Config, name: str, value: Any) -> int:
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    raise ConfigError(f"{config.path}: --{name} takes a whole number, got {value!r}")


KEYS = (  # the flags the rules read, each as spelled now and before OpenRLHF 0.10, in the order they are checked
    Key("enable", ("{prefix}gradient_checkpointing_enable", "gradient_checkpointing"), _switch, False),
    Key(
        "reentrant",
        ("{prefix}gradient_checkpointing_reentrant", "gradient_checkpointing_use_reentrant"),
        _switch,
        False,
    ),
    Key("lora_rank", ("ds.lora.rank", "lora_rank"), _whole, 0),
    Key("four_bit", ("ds.load_in_4bit", "load_in_4bit"), _switch, False),
    Key("zero_stage", ("ds.zero_stage", "zero_stage"), _whole, 2),
    Key("nodes", ("actor.num_nodes", "actor_num_nodes"), _whole, 1),
    Key("gpus", ("actor.num_gpus_per_node", "actor_num_gpus_per_node"), _whole, 1),
)

REENTRANT = (  # with checkpointing on, the loop passes {use_reentrant: <the switch>} to the enable call
    Step(
        lambda k, _: k.reentrant_name is None,
        False,
        "OpenRLHF passes {{use_reentrant: false}} without --{prefix}gradient_checkpointing_reentrant ({src[enable]})",
    ),
    Step(lambda k, _: k.reentrant_name is not None, True, "--{reentrant_name}", "file"),
)


def read(config: Config, ctx: Context) -> Reading:
    entry = str(config.values[ENTRY])
    ppo = entry == "train_ppo_ray"
    prefix = "actor." if ppo else "model."
    unread = (config.values.get(UNREAD) or {}).get("values", {})  # a value the expansion could not read: absent
    k = read_keys(config, KEYS, unread, prefix=prefix, src=SOURCES)
    reading = Reading(
        format="openrlhf",
        parser=f"the plugin's model of {VERSION_MODELLED} (OpenRLHF is not imported)",
        changes={
            "use_reentrant": "{switch} " + f"--{prefix}gradient_checkpointing_reentrant",
            "activation_checkpointing": "{switch} " + f"--{prefix}gradient_checkpointing_enable",
        },
    )
    _checkpointing(reading, k, ppo)
    _model(config, reading, prefix, k)
    reading.set(
        "zero_stage",
        k.zero_stage,
        "file" if k.zero_stage_name else "launcher default",
        f"--{k.zero_stage_name}" if k.zero_stage_name else f"OpenRLHF's default ZeRO stage ({SOURCES['zero']})",
    )
    launched = config.values.get("openrlhf_nproc")
    reading.set_world_size(
        ctx,
        "no process count in the command: 1 (pass --nproc N)",
        (
            launched if isinstance(launched, int) else None,
            "file",
            "the launcher's process count (deepspeed / torchrun)",
        ),
        (k.nodes * k.gpus if ppo and k.gpus_name else None, "file", "--actor.num_nodes x --actor.num_gpus_per_node"),
    )
    reading.set("ddp_find_unused_parameters", None, "launcher default", "DeepSpeed, not torch DDP")
    reading.set("ddp_static_graph", None, "launcher default", "DeepSpeed, not torch DDP")
    reading.set("fsdp", False, "launcher default", "OpenRLHF runs DeepSpeed")
    reading.set("fsdp_activation_checkpointing", False, "launcher default", "OpenRLHF runs DeepSpeed")
    _unread(config, reading, ctx, {name.format(prefix=prefix) for key in KEYS for name in key.names})
    kind = KINDS.get(entry, "sft")
    reading.set_trainer(kind, "file", f"openrlhf.cli.{entry}", rl=kind in RL, generates=kind in GENERATING)
    reading.notes.append(
        "OpenRLHF trains without a Trainer: the plugin acts through the model route (TRL_GC_PLUGIN=1 patches "
        'gradient_checkpointing_enable; see docs/routes.md, "Without a Trainer")'
    )
    return reading


def _unread(config: Config, reading: Reading, ctx: Context, flags: set[str]) -> None:
    """What the expansion left unread: in `Reading.unread` where the verdict depends on it, else as a note."""
    unread = config.values.get(UNREAD) or {}
    hidden, notes = shell.unread_words(unread.get("hidden", []), ctx.no_script_args)
    reading.notes += notes
    for what in hidden:
        reading.unread.append(f"{shell.readable(what)}: may hold any flag (checkpointing, LoRA, 4-bit, ZeRO stage)")
    for name, whats in unread.get("values", {}).items():
        said = ", ".join(shell.readable(w) for w in whats)
        if name in flags:
            reading.unread.append(f"--{name}: {said}")
        else:
            reading.notes.append(f"--{name}: its value is known only when the script runs ({said}); no rule reads it")
    if ctx.nproc is None:
        reading.unread += [
            f"the process count, {shell.readable(w)} (or pass --nproc N)" for w in unread.get("launch", [])
        ]


def _checkpointing(reading: Reading, k: Values, ppo: bool) -> None:
    on, on_name = k.enable, k.enable_name
    detail = f"--{on_name}" if on_name else f"no --{k.prefix}gradient_checkpointing_enable: OpenRLHF's default is off"
    if ppo:
        detail += f"; the critic checkpoints with the actor's flags ({SOURCES['critic']})"
    reading.set("gc_enabled", on, "file" if on_name else "launcher default", detail)
    reading.set("gc_flag_source", "user" if on_name else "unset", "file", detail)
    if not on:
        return
    kw = rewrite(REENTRANT, k, Reentrant(None, "file", ""))
    origin, why = kw.origin, kw.detail
    reading.set("use_reentrant", kw.value, origin, why)
    # the run's model route sees the kwargs passed to the enable call: the value is the loop's, kept as set
    reading.set("use_reentrant_source", "user", origin, why)
    reading.set("kwargs_given", True, origin, why)


def _model(config: Config, reading: Reading, prefix: str, k: Values) -> None:
    rank, rank_name, four, four_name = k.lora_rank, k.lora_rank_name, k.four_bit, k.four_bit_name
    peft = rank > 0
    reading.set_model(
        peft=Fact(
            peft,
            "file" if rank_name else "launcher default",
            f"--{rank_name} {rank}" if rank_name else "no LoRA rank: a full fine-tune",
        ),
        quant=Fact("bitsandbytes_4bit" if four else None, "file", f"--{four_name}" if four_name else "no 4-bit"),
        frozen=Fact(peft or four, "file", "LoRA / 4-bit"),
        blocks="a command trains the decoder blocks (fully or through LoRA)",
        grads=Fact(
            True,
            "launcher rewrite" if peft else "file",
            f"OpenRLHF calls enable_input_require_grads() before LoRA ({SOURCES['lora']})"
            if peft
            else "full fine-tune: the embeddings train",
        ),
        no_adapter="no LoRA",
    )
    name = config.values.get(
        "model.model_name_or_path", config.values.get(f"{prefix}model_name_or_path", config.values.get("pretrain"))
    )
    read_model_facts(name, "--model.model_name_or_path", reading)  # nothing unless a local model directory


NO_OWN_PARSER = (
    "OpenRLHF has no parser of its own to run on a command line (its flags are read by argparse inside the training "
    "script, which needs flash-attn and CUDA); the command is read by the plugin's model of OpenRLHF 0.11.2"
)
"""Why `--parser launcher` is refused for OpenRLHF command lines."""


LAUNCHER = Launcher(
    "openrlhf",
    "OpenRLHF",
    read,
    markers=MARKERS,
    strong_markers=STRONG_MARKERS,
    read_keys=READ_KEYS,
    no_parser=NO_OWN_PARSER,
)
"""OpenRLHF command lines (`parse_command`), read by the plugin's model only."""
