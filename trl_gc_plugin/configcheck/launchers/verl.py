"""verl launches (`python3 -m verl.trainer.main_ppo key=value ...`, `torchrun ... -m verl.trainer.sft_trainer ...`) in
a shell script, expanded statically (`shell.commands`: the Hydra overrides are mostly assembled in bash arrays), and
verl YAML configs (`actor_rollout_ref:` ...): the plugin's model of verl at 1dda039 (2026-08-22). verl is not imported
(it needs Ray, vLLM or SGLang, and CUDA). Every key, default and path below was read in that snapshot.

Overrides are Hydra's: `key=value` (the key must exist: Hydra refuses a new one), `+key=value` (adds a key),
`++key=value` (adds or overrides), `~key` (deletes). The script's own arguments (`"$@"`) are unread, as for OpenRLHF
(they may hold any override), unless `--no-script-args` reads them as none; `${VAR:-default}` is read as its default.
An override the expansion cannot read is named, and the verdict is then `incomplete`, never `ok`.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from typing import Any

from ..read import shell
from ..read.common import (
    Config,
    ConfigError,
    Context,
    Fact,
    LauncherRule,
    NotTrainingConfig,
    Origin,
    Reading,
    expect_mapping,
)
from ..read.model_config import local_model_config, read_model_facts
from .base import Launcher

COMMIT = "1dda039b9c6311889a9c9a26040677e1254814f9"
VERSION_MODELLED = "verl 1dda039 (main, 2026-08-22)"
SRC = f"https://github.com/verl-project/verl/blob/{COMMIT}/"
SOURCES = {
    "enable": SRC + "verl/workers/engine/fsdp/transformer_impl.py#L316-L317 "
    "(gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))",
    "lora": SRC + "verl/workers/engine/fsdp/transformer_impl.py#L320-L321 (enable_input_require_grads(), then PEFT)",
    "defaults": SRC + "verl/trainer/config/model/hf_model.yaml#L34-L43 "
    "(enable_gradient_checkpointing: True, enable_activation_offload: False, lora_rank: 0)",
    "strategy": SRC + "verl/trainer/config/ppo_trainer.yaml (model_engine: dp -> actor/dp_actor.yaml, strategy: fsdp; "
    "ppo_megatron_trainer.yaml: model_engine megatron)",
    "offload": SRC + "verl/utils/activation_offload.py#L544-L558 "
    "(gradient_checkpointing_disable() on every module, then its own reentrant checkpoint per FSDP unit)",
    "offload_strategy": SRC
    + "verl/utils/activation_offload.py#L521 (activation offloading only supports fsdp / fsdp2)",
    "megatron": SRC + "verl/trainer/config/engine/megatron.yaml#L74-L90 "
    "(override_transformer_config.recompute_granularity: null; the Megatron engine never reads "
    "enable_gradient_checkpointing)",
    "ray": SRC + "verl/trainer/main_ppo.py#L62-L74 (ray.init with verl's env_vars merged with "
    "ray_kwargs.ray_init.runtime_env)",
    "ulysses": "https://github.com/verl-project/verl/issues/4664 (FSDP2 + ulysses_sequence_parallel_size > 1: "
    "CheckpointError in the backward, the recomputed strides differ; FSDP1 and FSDP2 without Ulysses work; open)",
    "moe": "https://github.com/verl-project/verl/issues/7016 and https://github.com/verl-project/verl/issues/3258 "
    "(Qwen3-MoE + FSDP2 + checkpointing: CheckpointError in the first backward, open; FSDP1 works)",
    "misspelled": "https://github.com/verl-project/verl/issues/4672 "
    "(enable_activation_offloading written for enable_activation_offload)",
    "dedup": "https://github.com/modelscope/ms-swift/pull/10157 (an offloader that deduplicates saved tensors by "
    "storage address: a square transpose silently uses the wrong activations in backward)",
    "miles": "https://github.com/radixark/miles/pull/1593 (recompute asked for and silently dropped on the Megatron "
    "path: 90.9 GB instead of 44.1 GB)",
    "policies": "trl_gc_plugin/model/policies.py (selective blocks keep the router's gate output: the recompute "
    "routes as the forward did)",
}

ENTRY = "verl_entry"
"""The pseudo-key of the command's entry module (`verl.trainer.main_ppo`, ...) or `yaml` for a YAML config."""
UNREAD = "verl_unread"
"""The pseudo-key of what the expansion left unread: `{"values": {key: [what]}, "hidden": [...], "launch": [...]}`."""
OVERRIDES = "verl_overrides"
"""The pseudo-key of the overrides as written: `{key: (prefix, value)}`, prefix `""`, `"+"` or `"++"`."""
MARKERS = frozenset({ENTRY, "actor_rollout_ref"})
STRONG_MARKERS = MARKERS
READ_KEYS = frozenset({"actor_rollout_ref", "critic", "trainer", "ray_kwargs", "model_engine"})

STRATEGIES = ("fsdp", "fsdp2", "megatron", "veomni", "torchtitan", "automodel")
FSDP = frozenset({"fsdp", "fsdp2"})
ENGINE_STRATEGY = {"dp": "fsdp", "megatron": "megatron", "veomni": "veomni", "torchtitan": "torchtitan"}
"""`model_engine=<name>` (main_ppo) -> the actor's default strategy (`actor/<name>_actor.yaml`)."""
KNOWN_LEAVES = frozenset(
    {
        "enable_gradient_checkpointing",
        "enable_activation_offload",
        "entropy_checkpointing",
        "activation_checkpoint",
        "activation_checkpointing",
        "checkpoint",
        "checkpoint_engine",
        "dist_checkpointing_path",
        "dist_checkpointing_prefix",
        "enable_fsdp_offload",
        "grad_offload",
        "load_checkpoint_path",
        "offload_policy",
        "optimizer_offload",
        "param_offload",
        "recompute_granularity",
        "recompute_method",
        "recompute_modules",
        "recompute_num_layers",
        "use_checkpoint_opt_param_scheduler",
        "use_dist_checkpointing",
    }
)
"""Every key of verl's configs (`verl/trainer/config/**.yaml` at 1dda039) whose name holds checkpoint, offload or
recompute: another such name is one verl does not read."""
CHECKPOINT_KEYS = ("enable_gradient_checkpointing", "enable_activation_offload", "entropy_checkpointing")
MOE_NAME = re.compile(
    r"(?i)(?:moe|mixtral|[-_]a\d+(?:\.\d+)?b\b|gpt-oss|deepseek-v[234]|qwen3-next|qwen3[._]5-(?:35b|122b|397b)|"
    r"moonlight|kimi-k2|dbrx|jamba|glm-?4\.5|glm-?5)"
)
MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

_ENTRY_TOKEN = re.compile(r"^verl(?:\.[A-Za-z_]\w*)+$")
_ENTRY_FILE = re.compile(r"(?:^|/)verl/((?:trainer|experimental)/[\w/]+)\.py$")
_END = frozenset({"&&", "||", ";", "|", "&"})
_REDIRECT = re.compile(r"^(?:\d*[<>]|&>)")
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][\w\-]*(?:\.[A-Za-z_0-9][\w\-]*)*)(?:=(.*))?$", re.S)
_CONFIG_FLAGS = {"--config-name": "name", "-cn": "name", "--config-path": "path", "-cp": "path", "--config-dir": "dir"}
_EXPORT = re.compile(r"^\s*(?:export\s+|env\s+)?TRL_GC_PLUGIN=(\S*)", re.M)


def mentions(text: str) -> bool:
    """`text` may hold a verl command: what `parse_command` looks for."""
    return re.search(r"\bverl\b", text) is not None


def _entry_of(words: list[str]) -> list[tuple[int, str]]:
    """(index, module) of each verl entry in `words`: `-m verl.x.y` (also after a launcher module: `-m
    verl_mlite.launch verl.trainer.sft_trainer`), or a path to verl's `trainer/*.py`."""
    out = []
    modules = ("-m", "--module")
    for i, word in enumerate(words):
        if _ENTRY_TOKEN.match(word) and i > 0 and (words[i - 1] in modules or (i > 1 and words[i - 2] in modules)):
            out.append((i, word))
        elif (m := _ENTRY_FILE.search(word)) is not None:
            out.append((i, "verl." + m.group(1).replace("/", ".")))
    return out


def kind_of(entry: str) -> str | None:
    """`sft` (`verl.trainer.sft_trainer`), `ppo` (every RL entry: `verl.trainer.main_*`, an experimental `*_main`),
    or None for an entry that trains nothing (generation, evaluation, the model merger, ...)."""
    name = entry.rsplit(".", 1)[-1]
    if "generation" in name or "eval" in name:
        return None
    if entry.startswith("verl.trainer.sft_trainer"):
        return "sft"
    if entry.startswith("verl.trainer.main_") or (entry.startswith("verl.experimental.") and "main" in name):
        return "ppo"
    return None


def parse_command(path: str, text: str) -> Config:
    """The overrides of the verl command in `text` as flat dotted keys, and `ENTRY`, `UNREAD`, `OVERRIDES`,
    `verl_config_name`, `verl_nproc`, `verl_env` (what the script sets `TRL_GC_PLUGIN` to); `NotTrainingConfig` when
    no command runs a verl entry point."""
    try:
        found, missing = shell.commands(text, "verl", os.path.dirname(os.path.abspath(path)))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    runs = [(e, entries) for e in found if (entries := _entry_of(e.words))]
    if not runs:
        _no_entry(path, found, missing)
    training = [(e, entries) for e, entries in runs if any(kind_of(name) for _, name in entries)] or runs
    names = sorted({name for _, entries in training for _, name in entries})
    if len(names) > 1:
        raise ConfigError(f"{path}: several verl commands ({', '.join(names)}); check one command per file")
    expanded, entries = training[0]
    others = sum(
        1
        for e, _ in training[1:]
        if [shell.readable(w) for w in e.words] != [shell.readable(w) for w in expanded.words]
    )
    start, entry = entries[0]
    values: dict[str, Any] = {ENTRY: entry}
    overrides, unread_values, hidden, notes = _overrides(expanded, start, values)
    if others:
        hidden.append(
            f"{others} other command(s) run {entry} with other overrides (branches of the script?); the first was read"
        )
    nproc, launch_unread = _processes(expanded.words[:start], expanded)
    if nproc is not None:
        values["verl_nproc"] = nproc
    exported = [m.group(1) for m in _EXPORT.finditer(text)]
    exported += [w.split("=", 1)[1] for w in expanded.words[:start] if w.startswith("TRL_GC_PLUGIN=")]
    if exported:
        values["verl_env"] = exported[-1]
    for i, word in enumerate(expanded.words[:start]):  # `ray job submit --runtime-env(-json) ... -- python3 -m ...`
        flag, eq, inline = word.partition("=")
        if flag in ("--runtime-env-json", "--runtime-env"):
            value = inline if eq else (expanded.words[i + 1] if i + 1 < start else "")
            values["verl_ray_job_env"] = (flag, shell.readable(value))
    values[OVERRIDES] = overrides
    values[UNREAD] = {"values": unread_values, "hidden": hidden, "launch": launch_unread, "notes": notes}
    return Config(path=path, values=values, keys=tuple(values), kind="command")


def _no_entry(path: str, found: list[shell.Expanded], missing: list[str]) -> None:
    """Raise what the script runs instead of a verl entry point: a program the check cannot read (`$COMMAND
    key=value ...`, Hydra's overrides), a sourced file not found, or nothing of OpenRLHF's or verl's."""
    for e in found:
        overrides = [w for w in e.words[1:] if (m := _OVERRIDE.match(w)) and m.group(3) is not None and "." in w]
        if e.words and e.what(e.words[0]) and len(overrides) >= 3:
            raise ConfigError(
                f"{path}: the program of the command with the Hydra overrides ({shell.readable(overrides[0])}, "
                f"...) is {shell.readable(e.what(e.words[0])[0])}: which entry point runs is known only when the "
                "script runs; check the command as it runs"
            )
    sourced = f"; it sources {', '.join(missing)}, not found here: check it where it is" if missing else ""
    raise (ConfigError if missing else NotTrainingConfig)(
        f"{path}: no OpenRLHF entry point (`openrlhf.cli.train_*`) and no verl entry point (`python3 -m "
        "verl.trainer.main_ppo`, `-m verl.trainer.sft_trainer`, ...) in any command of the script (read as bash "
        f"would expand it: variables, arrays, heredocs, `bash -c` payloads, sourced files){sourced}"
    )


def _overrides(
    expanded: shell.Expanded, start: int, values: dict[str, Any]
) -> tuple[dict[str, tuple[str, Any]], dict[str, list[str]], list[str], list[str]]:
    """Read the words after the entry point into `values`: (the overrides as written, the keys whose values were
    not read, what may hold any override, notes)."""
    overrides: dict[str, tuple[str, Any]] = {}
    unread: dict[str, list[str]] = {}
    hidden: list[str] = []
    notes: list[str] = []
    words = list(expanded.words)
    i = start + 1
    while i < len(words) and words[i] not in _END and not _REDIRECT.match(words[i]):
        word = words[i]
        i += 1
        whats = expanded.what(word)
        if whats and shell._PLACEHOLDER.fullmatch(word):
            if (same := _alternatives(expanded, word)) is not None:
                notes.append(same[0])
                words[i:i] = same[1]  # the overrides every value holds are read as written
            else:
                hidden += whats
            continue
        flag, eq, inline = word.partition("=")
        if flag in _CONFIG_FLAGS:
            value = inline if eq else (words[i] if i < len(words) else "")
            i += 0 if eq else 1
            if expanded.what(value):
                hidden += [f"{flag} {what}" for what in expanded.what(value)]
            else:
                values[f"verl_config_{_CONFIG_FLAGS[flag]}"] = value
            continue
        match = None if word.startswith("-") else _OVERRIDE.match(word)
        if match is None or (match.group(3) is None and match.group(1) != "~"):
            if shell._PLACEHOLDER.search(flag):
                hidden += expanded.what(flag)
            else:
                notes.append(f"{shell.readable(word)}: not a Hydra override (key=value); no rule reads it")
            continue
        prefix, key, value = match.group(1) or "", match.group(2), match.group(3)
        unread.pop(key, None)
        if prefix == "~":
            values.pop(key, None)
            overrides[key] = ("~", None)
            continue
        if whats:
            unread[key] = whats
        values[key] = overrides[key] = _value(value)
        overrides[key] = (prefix, values[key])
    return overrides, unread, hidden, notes


RULE_LEAVES = frozenset(
    {
        "enable_gradient_checkpointing",
        "enable_activation_offload",
        "lora_rank",
        "strategy",
        "ulysses_sequence_parallel_size",
    }
)


def rule_key(key: str) -> bool:
    """A key some rule of this module reads, one that chooses the engine, or a checkpointing / offload key verl
    does not have (the misspelling rules read those)."""
    leaf = key.rsplit(".", 1)[-1]
    return (
        key in ("model_engine", "engine")
        or leaf in RULE_LEAVES
        or leaf.startswith("recompute_")
        or key.endswith("model.path")
        or key in ("path", "model.path")
        or "TRL_GC_PLUGIN" in key
        or (leaf not in KNOWN_LEAVES and re.search(r"checkpoint|offload|recompute", leaf) is not None)
    )


def _alternatives(expanded: shell.Expanded, word: str) -> tuple[str, list[str]] | None:
    """For an array set in a branch (`RAY=(...)` before an `if`, another inside it): when every value the script
    gives it holds the same overrides of the keys the rules read (others may differ), a note and those overrides;
    None otherwise (then it is unread)."""
    match = shell._PLACEHOLDER.fullmatch(word)
    alternatives = expanded.alternatives.get(int(match.group(1))) if match else None
    if not alternatives:
        return None
    keys: set[str] = set()
    relevant: list[list[str]] = []
    for words in alternatives:
        mine = []
        for w in words:
            found = _OVERRIDE.match(w)
            if found is None or found.group(3) is None or shell._PLACEHOLDER.search(found.group(2)):
                return None
            keys.add(found.group(2))
            if rule_key(found.group(2)):
                if shell._PLACEHOLDER.search(w):
                    return None
                mine.append(w)
        relevant.append(sorted(mine))
    if any(r != relevant[0] for r in relevant):
        return None
    what = shell.readable(expanded.what(word)[0].split(":", 1)[0])
    same = f"; each holds {' '.join(relevant[0])}" if relevant[0] else "; no rule reads their keys"
    note = f"{what}: set in a branch, to one of {len(alternatives)} values ({', '.join(sorted(keys)) or 'empty'}){same}"
    return note, relevant[0]


def _value(text: str) -> Any:
    """A Hydra override's value as the rules compare it: booleans, integers, null; anything else a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "~", "none"):
        return None
    if re.fullmatch(r"-?\d+", low):
        return int(low)
    return text


def _processes(words: list[str], expanded: shell.Expanded) -> tuple[int | None, list[str]]:
    """`torchrun --nproc_per_node N [--nnodes M]` before the entry: the process count, and what of it was unread."""
    if not any(w.endswith("torchrun") or w == "torch.distributed.run" for w in words):
        return None, []
    unread: list[str] = []

    def number(flag: str) -> int | None:
        for t, following in zip(words, [*words[1:], None], strict=True):
            value = t[len(flag) + 1 :] if t.startswith(flag + "=") else following if t == flag else None
            if value is not None and expanded.what(value):
                unread.extend(f"{flag} {shell.readable(what)}" for what in expanded.what(value))
                return None
            if value is not None and value.isdigit():
                return int(value)
        return None

    per_node = number("--nproc_per_node") or number("--nproc-per-node")
    nodes = number("--nnodes")
    return (None if per_node is None else per_node * (nodes or 1)), unread


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A YAML config's nested mappings as dotted keys (`{"a": {"b": 1}}` -> `{"a.b": 1}`)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


# --- the rules ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """What the rules look at, read from the launch (`read` builds it)."""

    strategy: str
    gc: bool
    gc_written: bool
    moe: bool | None
    ulysses: int
    offload: bool
    offload_without_gc: tuple[str, ...]
    misspelled_refused: tuple[str, ...]
    misspelled_ignored: tuple[str, ...]
    recompute: tuple[str, ...]
    ray: bool
    env_exported: bool
    env_passed: bool


RAY_ENV = "+ray_kwargs.ray_init.runtime_env.env_vars.TRL_GC_PLUGIN=1"
RULES: tuple[LauncherRule, ...] = (
    LauncherRule(
        id="verl:ulysses-fsdp2-checkpointing",
        action="error",
        setting="activation_checkpointing",
        condition="strategy fsdp2, ulysses_sequence_parallel_size > 1 and enable_gradient_checkpointing (transformers' "
        "non-reentrant checkpointing: without enable_activation_offload)",
        message=(
            "verl starts, then the first backward stops with torch's CheckpointError (the recomputed tensors' strides "
            "are ulysses_sequence_parallel_size times the saved ones): FSDP2 with Ulysses sequence parallelism and "
            "checkpointing, reported on verl 0.6.1 and open (#4664); FSDP1 with Ulysses and FSDP2 without it work."
        ),
        change="set actor_rollout_ref.actor.strategy=fsdp (engine.strategy=fsdp for sft_trainer): FSDP1 works with "
        "Ulysses, verl #4664",
        evidence=(SOURCES["ulysses"], SOURCES["enable"]),
        when=lambda v: v.strategy == "fsdp2" and v.ulysses > 1 and v.gc and not v.offload,
        remove_when="verl #4664 is fixed in the verl release the launch uses",
    ),
    LauncherRule(
        id="verl:moe-fsdp2-checkpointing",
        action="warn",
        setting="activation_checkpointing",
        condition="an MoE model, strategy fsdp2, and enable_gradient_checkpointing",
        message=(
            "MoE + FSDP2 + checkpointing: verl #7016 (Qwen3-30B-A3B) fails in the first actor backward with "
            "CheckpointError, a different number of tensors saved in the recompute than in the forward (the router "
            "dispatches otherwise), and FSDP1 trains the same config; #3258 is the same error with "
            "offload_policy=True. Where the plugin runs in the workers (TRL_GC_PLUGIN=1 through the Ray runtime env) "
            "and makes a block selective, that block keeps the router's gate output, so its recompute routes as the "
            "forward did; the plugin's run with verl's MoE path is not tested."
        ),
        change="set actor_rollout_ref.actor.strategy=fsdp (engine.strategy=fsdp for sft_trainer): FSDP1 trains this "
        "config, verl #7016; or enable_gradient_checkpointing=False",
        evidence=(SOURCES["moe"], SOURCES["policies"], SOURCES["enable"]),
        when=lambda v: bool(v.moe) and v.strategy == "fsdp2" and v.gc and not v.offload,
        remove_when="verl #7016 and #3258 are fixed in the verl release the launch uses",
    ),
    LauncherRule(
        id="verl:misspelled-key-refused",
        action="error",
        setting="config",
        condition="an override (without `+`) of a checkpointing or offload key verl's config does not have",
        message=(
            "Hydra refuses an override of a key the config does not have (`Key '...' is not in struct`): verl does not "
            "start (the spelling verl reads is named in the note; verl #4672)."
        ),
        evidence=(SOURCES["misspelled"], SOURCES["defaults"]),
        when=lambda v: bool(v.misspelled_refused),
        remove_when="never: a key verl does not read",
    ),
    LauncherRule(
        id="verl:misspelled-key-ignored",
        action="warn",
        setting="config",
        condition="an added (`+` / `++`) or YAML checkpointing or offload key verl does not read",
        message=(
            "The key is added to the config, but verl reads another spelling: what it asks for is not applied (or the "
            "config class refuses it at startup), verl #4672; the spelling verl reads is named in the note."
        ),
        evidence=(SOURCES["misspelled"], SOURCES["defaults"]),
        when=lambda v: bool(v.misspelled_ignored),
        remove_when="never: a key verl does not read",
    ),
    LauncherRule(
        id="verl:offload-without-checkpointing",
        action="warn",
        setting="activation_checkpointing",
        condition="enable_activation_offload=True and enable_gradient_checkpointing=False (fsdp / fsdp2)",
        message=(
            "Without checkpointing, verl's activation offloader handles every tensor each layer saves for backward "
            "and deduplicates them by storage address; with SDPA a square transpose shares its storage with its "
            "input, and the backward silently reads the wrong activations (the bug ms-swift PR #10157 fixes in the "
            "same offloader design). With checkpointing on, only each unit's inputs are saved."
        ),
        change="set enable_gradient_checkpointing=True beside enable_activation_offload=True",
        evidence=(SOURCES["offload"], SOURCES["dedup"]),
        when=lambda v: bool(v.offload_without_gc),
        remove_when="verl's offloader keys saved tensors by more than their storage address",
    ),
    LauncherRule(
        id="verl:megatron-recompute-not-applied",
        action="warn",
        setting="activation_checkpointing",
        condition="strategy megatron, enable_gradient_checkpointing written true, and no "
        "megatron.override_transformer_config.recompute_* override",
        message=(
            "The Megatron engine never reads enable_gradient_checkpointing: checkpointing is asked for and not applied "
            "(recompute_granularity defaults to null); radixark/miles PR #1593 measured 90.9 GB instead of 44.1 GB "
            "where recompute was silently dropped."
        ),
        change="add +actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full "
        "(and recompute_method=uniform, recompute_num_layers=1)",
        evidence=(SOURCES["megatron"], SOURCES["miles"]),
        when=lambda v: v.strategy == "megatron" and v.gc_written and not v.recompute,
        remove_when="verl's Megatron engine maps enable_gradient_checkpointing to Megatron's recompute",
    ),
    LauncherRule(
        id="verl:plugin-not-in-ray-workers",
        action="warn",
        setting="config",
        condition="the script sets TRL_GC_PLUGIN and does not pass it to the Ray workers' runtime env",
        message=(
            "verl's workers are Ray actors: a variable the script exports reaches only the processes Ray starts from "
            "this shell's environment; on a cluster started before (`ray start`, several nodes, `ray job submit`) the "
            "workers never see it, and the plugin does not run where the model checkpoints. verl merges "
            "ray_kwargs.ray_init.runtime_env into ray.init's runtime env, whose env_vars reach every worker."
        ),
        change=f"add {RAY_ENV}",
        evidence=(SOURCES["ray"],),
        when=lambda v: v.ray and v.env_exported and not v.env_passed,
        remove_when="never: Ray's runtime env is how a variable reaches workers on every node",
    ),
)


# --- reading -----------------------------------------------------------------------------------------------------


@dataclass
class _Keys:
    """The keys of one launch, as the entry spells them."""

    model: str
    strategy: str
    ulysses: tuple[str, ...]
    recompute: str
    sections: tuple[str, ...]


PPO_KEYS = _Keys(
    model="actor_rollout_ref.model.",
    strategy="actor_rollout_ref.actor.strategy",
    ulysses=(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
    ),
    recompute="actor_rollout_ref.actor.megatron.override_transformer_config.recompute_",
    sections=("actor_rollout_ref.model.", "critic.model.", "actor_rollout_ref.actor.", "critic."),
)
SFT_KEYS = _Keys(
    model="model.",
    strategy="engine.strategy",
    ulysses=("engine.ulysses_sequence_parallel_size",),
    recompute="engine.override_transformer_config.recompute_",
    sections=("model.", "engine."),
)


class _Values:
    """The launch's values by dotted key, what of them was not read, and where each came from."""

    def __init__(self, config: Config) -> None:
        self.yaml = config.kind != "command"
        self.values = flatten(config.values) if self.yaml else config.values
        self.overrides: dict[str, tuple[str, Any]] = (
            {k: ("", v) for k, v in self.values.items()} if self.yaml else config.values.get(OVERRIDES, {})
        )
        unread = {} if self.yaml else config.values.get(UNREAD) or {}
        self.unread: dict[str, list[str]] = unread.get("values", {})
        self.hidden: list[str] = unread.get("hidden", [])
        self.launch: list[str] = unread.get("launch", [])
        self.notes: list[str] = unread.get("notes", [])
        self.read_keys: set[str] = set()

    def get(self, key: str, default: Any) -> tuple[Any, bool]:
        """(value, written): the launch's value of `key` or `default`; a value the expansion could not read counts
        as not written (and is named unread when the verdict depends on it)."""
        self.read_keys.add(key)
        if key in self.values and key not in self.unread:
            return self.values[key], True
        return default, False

    def where(self, key: str) -> str:
        return f"key {key}" if self.yaml else f"override {self.overrides.get(key, ('', ''))[0]}{key}"


def _bool(v: _Values, path: str, key: str, default: bool) -> tuple[bool, bool]:
    value, written = v.get(key, default)
    if isinstance(value, bool):
        return value, written
    if isinstance(value, int) and value in (0, 1):
        return bool(value), written
    raise ConfigError(f"{path}: {v.where(key)}: verl reads a boolean here (True / False), got {value!r}")


def _int(v: _Values, path: str, key: str, default: int) -> tuple[int, bool]:
    value, written = v.get(key, default)
    if isinstance(value, int) and not isinstance(value, bool):
        return value, written
    raise ConfigError(f"{path}: {v.where(key)}: verl reads a whole number here, got {value!r}")


VERL_CONFIGS = frozenset(
    {
        "ppo_trainer",
        "ppo_megatron_trainer",
        "sft_trainer_engine",
        "fully_async_ppo_trainer",
        "fully_async_ppo_megatron_trainer",
        "one_step_off_ppo_trainer",
        "one_step_off_ppo_megatron_trainer",
    }
)
"""verl's own top-level training configs (`verl/**/config/*.yaml` at 1dda039): their defaults are the ones
modelled; `--config-path config` (or `./config`) is the entry's own directory (Hydra resolves it beside the
`@hydra.main` file)."""


def _config_unread(config: Config) -> str | None:
    """What of a `--config-path` / `--config-name` the check does not read: a config of the user's own."""
    name = str(config.values.get("verl_config_name", "")).removesuffix(".yaml")
    path = config.values.get("verl_config_path")
    if path is not None and str(path).rstrip("/") not in ("config", "./config"):
        return f"--config-path {path} --config-name {name or '(the entry default)'}: a config of your own, not read"
    if name and name not in VERL_CONFIGS:
        return f"--config-name {name}: not one of verl's configs; its contents are not read"
    return None


def _strategy(v: _Values, config: Config, keys: _Keys, sft: bool) -> tuple[str, str]:
    """(strategy, where it comes from)."""
    value, written = v.get(keys.strategy, None)
    if written and value is not None:
        return str(value), v.where(keys.strategy)
    if sft:
        engine, engine_written = v.get("engine", "fsdp")
        if engine_written:
            return str(engine), "override engine=" + str(engine)
        return "fsdp", "sft_trainer_engine.yaml's default engine: fsdp (strategy fsdp)"
    engine, engine_written = v.get("model_engine", None)
    name = config.values.get("verl_config_name")
    if engine_written and engine in ENGINE_STRATEGY:
        return ENGINE_STRATEGY[engine], f"model_engine={engine} (actor/{engine}_actor.yaml)"
    if isinstance(name, str) and "megatron" in name:
        return "megatron", f"--config-name {name}"
    return "fsdp", f"verl's default: model_engine dp, strategy fsdp ({SOURCES['strategy']})"


def _moe(v: _Values, path_key: str, reading: Reading) -> tuple[bool | None, str]:
    """Whether the model is an MoE: from its local config.json, else from its name (said), None when unknown."""
    name, _ = v.get(path_key, None)
    if path_key in v.unread:
        tail = shell.readable(str(v.values.get(path_key, ""))).rsplit("<unread>", 1)[-1].strip("/")
        if not tail or not re.search(r"[A-Za-z]", tail):
            return None, f"{path_key}: not read"
        reading.extra["path_by_name"] = True
        moe = MOE_NAME.search(tail)
        said = f"{tail!r} (the rest of the path is not read): " + (
            f"an MoE by its name ({moe.group(0)!r})" if moe else "no MoE by its name"
        )
        return moe is not None, said
    if not isinstance(name, str) or not name:
        return None, "no model path"
    found = local_model_config(os.path.expanduser(name))
    if found is not None:
        file, data = found
        configs = [data, *(c for c in data.values() if isinstance(c, dict))]
        moe = any(isinstance(c.get(k), int) and c[k] > 1 for c in configs for k in MOE_CONFIG_KEYS)
        return moe, f"{file}: {'/'.join(MOE_CONFIG_KEYS)}"
    match = MOE_NAME.search(name)
    if match:
        return True, f"{name!r}: an MoE by its name ({match.group(0)!r}; the check downloads nothing)"
    return False, f"{name!r}: no MoE by its name (no local config.json to read; the check downloads nothing)"


def read(config: Config, ctx: Context) -> Reading:
    entry = str(config.values.get(ENTRY, "yaml"))
    kind = "ppo" if entry == "yaml" else kind_of(entry)
    v = _Values(config)
    keys = SFT_KEYS if kind == "sft" else PPO_KEYS
    reading = Reading(
        format="verl",
        parser=f"the plugin's model of {VERSION_MODELLED} (verl is not imported)",
        changes={"activation_checkpointing": f"{keys.model}enable_gradient_checkpointing={{value}}"},
    )
    reading.notes += v.notes
    if v.yaml:
        for key in ("actor_rollout_ref", "critic", "trainer", "ray_kwargs"):
            if key in config.values:
                expect_mapping(config.values[key], config.path, key, config.lines)
        if not {"actor_rollout_ref", "critic"} & set(config.keys):
            reading.unread.append(
                "no key of verl's (actor_rollout_ref, critic) in the file: nothing of a verl launch was read"
            )
    if kind is None:
        reading.training = False
        reading.notes.append(f"{config.path} runs {entry}: nothing trains, so checkpointing does not apply")
        return reading
    if (own := _config_unread(config)) is not None:
        reading.unread.append(f"{own} (its defaults decide checkpointing, strategy and LoRA here)")
    strategy, strategy_why = _strategy(v, config, keys, kind == "sft")
    if strategy not in STRATEGIES:
        reading.unread.append(
            f"strategy {strategy!r} ({strategy_why}): an engine the check does not model (verl's own are "
            f"{', '.join(STRATEGIES)}); how it checkpoints is not known"
        )
    origin: Origin = "file" if "override" in strategy_why or "key" in strategy_why else "launcher default"
    reading.set("strategy", strategy, origin, strategy_why)
    gc, gc_written, offload = _checkpointing(v, reading, config.path, keys, strategy)
    moe = _model(v, reading, config.path, keys)
    ulysses = _launch(v, reading, config, ctx, keys, strategy)
    reading.set_trainer(kind, "file", entry, rl=kind == "ppo", generates=kind == "ppo")
    _rules(v, reading, config, keys, strategy, (gc, gc_written, offload, moe, ulysses))
    _unread(v, reading, ctx, keys, strategy in FSDP and gc, strategy)
    return reading


def _checkpointing(v: _Values, reading: Reading, path: str, keys: _Keys, strategy: str) -> tuple[bool, bool, bool]:
    """The checkpointing facts: (enable_gradient_checkpointing, written, enable_activation_offload)."""
    gc, gc_written = _bool(v, path, keys.model + "enable_gradient_checkpointing", True)
    offload, _ = _bool(v, path, keys.model + "enable_activation_offload", False)
    gc_detail = (
        f"{v.where(keys.model + 'enable_gradient_checkpointing')}"
        if gc_written
        else f"verl's default enable_gradient_checkpointing: True ({SOURCES['defaults']})"
    )
    hf_engine = strategy in FSDP
    if hf_engine:
        reading.set("gc_enabled", gc, "file" if gc_written else "launcher default", gc_detail)
    else:
        reading.set(
            "gc_enabled",
            False,
            "launcher default",
            f"the {strategy} engine does not call transformers' gradient_checkpointing_enable ({gc_detail}: "
            "the plugin's model-route rules do not see it)",
        )
    reading.set("gc_flag_source", "user" if gc_written else "unset", "file", gc_detail)
    if hf_engine and gc and offload:
        reading.set("use_reentrant", True, "launcher rewrite", f"verl's activation offloader ({SOURCES['offload']})")
        reading.set("use_reentrant_source", "unknown", "launcher rewrite", SOURCES["offload"])
        reading.notes.append(
            "enable_activation_offload: verl's offloader calls gradient_checkpointing_disable() and checkpoints each "
            "FSDP unit itself (reentrant); where TRL_GC_PLUGIN=1 runs in the workers, the plugin stands back there "
            "and says so once"
        )
    elif hf_engine and gc:
        why = f"verl passes {{use_reentrant: false}} ({SOURCES['enable']})"
        reading.set("use_reentrant", False, "launcher rewrite", why)
        reading.set("use_reentrant_source", "user", "launcher rewrite", why)
        reading.set("kwargs_given", True, "launcher rewrite", why)
    if offload:
        reading.set("activation_offloading", True, "file", v.where(keys.model + "enable_activation_offload"))
    return gc, gc_written, offload


def _model(v: _Values, reading: Reading, path: str, keys: _Keys) -> bool | None:
    """The model facts (LoRA, the local config's, MoE); whether it is an MoE (None: unknown)."""
    rank, rank_written = _int(v, path, keys.model + "lora_rank", 0)
    peft = rank > 0
    reading.set_model(
        peft=Fact(peft, "file" if rank_written else "launcher default", f"{keys.model}lora_rank {rank}"),
        quant=Fact(None, "launcher default", "verl's FSDP engine loads no 4-bit model"),
        frozen=Fact(peft, "file", "LoRA" if peft else "no LoRA: a full fine-tune"),
        blocks="a launch trains the decoder blocks (fully or through LoRA)",
        grads=Fact(
            True,
            "launcher rewrite" if peft else "file",
            f"verl calls enable_input_require_grads() before LoRA ({SOURCES['lora']})"
            if peft
            else "full fine-tune: the embeddings train",
        ),
        no_adapter="no LoRA",
    )
    model_path, _ = v.get(keys.model + "path", None)
    if isinstance(model_path, str) and keys.model + "path" not in v.unread:
        read_model_facts(os.path.expanduser(model_path), keys.model + "path", reading)
    moe, moe_why = _moe(v, keys.model + "path", reading)
    if moe is not None:
        reading.set("moe", moe, "model config" if "config.json" in moe_why else "assumed", moe_why)
    return moe


def _launch(v: _Values, reading: Reading, config: Config, ctx: Context, keys: _Keys, strategy: str) -> int:
    """The parallelism facts; the Ulysses size."""
    fsdp = strategy in FSDP
    reading.set("fsdp", fsdp, "file", f"strategy {strategy}")
    if fsdp:
        reading.set("fsdp_version", 2 if strategy == "fsdp2" else 1, "file", f"strategy {strategy}")
    reading.set("fsdp_activation_checkpointing", False, "launcher default", "verl checkpoints through transformers")
    reading.set("zero_stage", None, "launcher default", "verl runs no DeepSpeed")
    reading.set("ddp_find_unused_parameters", None, "launcher default", "verl runs no torch DDP")
    reading.set("ddp_static_graph", None, "launcher default", "verl runs no torch DDP")
    ulysses = max(_int(v, config.path, key, 1)[0] for key in keys.ulysses)
    if ulysses > 1:
        reading.set("ulysses", ulysses, "file", " / ".join(k for k in keys.ulysses if k in v.values))
    gpus, gpus_written = v.get("trainer.n_gpus_per_node", 8)
    nodes, _ = v.get("trainer.nnodes", 1)
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (gpus, nodes)):
        reading.notes.append(f"trainer.n_gpus_per_node x trainer.nnodes: {gpus!r} x {nodes!r}, not whole numbers here")
        gpus = None
    launched = config.values.get("verl_nproc")
    reading.set_world_size(
        ctx,
        "no process count in the command: 1 (pass --nproc N)",
        (launched if isinstance(launched, int) else None, "file", "torchrun's --nproc_per_node x --nnodes"),
        (
            gpus * nodes if gpus is not None and keys is PPO_KEYS else None,
            "file" if gpus_written else "launcher default",
            "trainer.n_gpus_per_node x trainer.nnodes (verl's defaults 8 x 1)",
        ),
    )
    return ulysses


def _rules(
    v: _Values, reading: Reading, config: Config, keys: _Keys, strategy: str, read: tuple[bool, bool, bool, Any, int]
) -> None:
    """The rules' view of the launch, and their decisions."""
    gc, gc_written, offload, moe, ulysses = read
    offload_without_gc: list[str] = []
    for section in ("model.",) if keys is SFT_KEYS else ("actor_rollout_ref.model.", "critic.model."):
        on, _ = _bool(v, config.path, section + "enable_activation_offload", False)
        with_gc, _ = _bool(v, config.path, section + "enable_gradient_checkpointing", True)
        if on and not with_gc and strategy in FSDP:
            offload_without_gc.append(section)
    refused, ignored = _misspelled(v, keys, reading)
    ray = keys is PPO_KEYS
    env_passed = any(
        k.startswith("ray_kwargs.ray_init.runtime_env.env_vars") and "TRL_GC_PLUGIN" in k for k in v.values
    )
    exported = config.values.get("verl_env") not in (None, "", "0")
    job_env = config.values.get("verl_ray_job_env")
    if job_env is not None and exported and not env_passed:
        flag, value = job_env
        if flag == "--runtime-env-json" and "TRL_GC_PLUGIN" in value:
            env_passed = True
        elif flag == "--runtime-env":  # a file: whether it passes the variable is not read
            env_passed = True
            reading.notes.append(f"ray job submit --runtime-env {value}: pass TRL_GC_PLUGIN under its env_vars")
    view = View(
        strategy=strategy,
        gc=gc,
        gc_written=gc_written and gc,
        moe=moe,
        ulysses=ulysses,
        offload=offload,
        offload_without_gc=tuple(offload_without_gc),
        misspelled_refused=refused,
        misspelled_ignored=ignored,
        recompute=tuple(k for k in v.values if k.startswith(keys.recompute) and v.values[k] is not None),
        ray=ray,
        env_exported=exported,
        env_passed=env_passed,
    )
    reading.apply(RULES, view, VERSION_MODELLED, {}, {"activation_checkpointing": gc, "config": None})
    if ray and exported and env_passed:
        reading.notes.append("TRL_GC_PLUGIN reaches the Ray workers through ray_kwargs.ray_init.runtime_env.env_vars")
    if ray:
        reading.notes.append(
            "verl trains in Ray workers without a Trainer: the plugin acts there through the model route "
            f"(TRL_GC_PLUGIN=1 patches gradient_checkpointing_enable) when the variable reaches them ({RAY_ENV})"
        )


def _misspelled(v: _Values, keys: _Keys, reading: Reading) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The overrides (or YAML keys) under verl's model / actor / engine sections whose name speaks of checkpointing
    or offloading and is none verl reads: (without `+`: Hydra refuses them; added: verl ignores them)."""
    refused: list[str] = []
    ignored: list[str] = []
    for key, (prefix, _) in v.overrides.items():
        if not any(key.startswith(s) for s in keys.sections) or prefix == "~":
            continue
        leaf = key.rsplit(".", 1)[-1]
        if leaf in KNOWN_LEAVES or not re.search(r"checkpoint|offload|recompute", leaf):
            continue
        if ".megatron.override_transformer_config." in key or ".override_config." in key:
            continue  # passed through to Megatron's / the model's config: not verl's keys
        close = difflib.get_close_matches(leaf, CHECKPOINT_KEYS + tuple(sorted(KNOWN_LEAVES)), n=1, cutoff=0.6)
        meant = key[: len(key) - len(leaf)] + close[0] if close else None
        said = f"{prefix}{key}" + (f": verl reads {meant}" if meant else ": verl reads no such key")
        (refused if (prefix == "" and not v.yaml) else ignored).append(key)
        reading.notes.append(said)
    return tuple(refused), tuple(ignored)


def _unread(v: _Values, reading: Reading, ctx: Context, keys: _Keys, hf_gc: bool, strategy: str) -> None:
    """What the expansion left unread: in `Reading.unread` where the verdict depends on it, else as a note."""
    hidden, notes = shell.unread_words(v.hidden, ctx.no_script_args)
    reading.notes += notes
    for what in hidden:
        reading.unread.append(
            f"{shell.readable(what)}: may hold any override (checkpointing, offload, strategy, LoRA, model)"
        )
    read = set(v.read_keys)
    for key, whats in v.unread.items():
        said = ", ".join(shell.readable(w) for w in whats)
        leaf = key.rsplit(".", 1)[-1]
        misspelled = leaf not in KNOWN_LEAVES and re.search(r"checkpoint|offload|recompute", leaf)
        depends = key in read or key.startswith(keys.recompute) or bool(misspelled)
        if key == keys.model + "path" and (reading.extra.get("path_by_name") or not (hf_gc and strategy == "fsdp2")):
            depends = False  # whether it is an MoE decides only the FSDP2 checkpointing rule
        if key.startswith("trainer.") and ctx.nproc is None:
            depends = False  # the process count decides no rule here (the one that reads it needs bitsandbytes)
        if depends:
            reading.unread.append(f"{key}: {said}")
        elif key == keys.model + "path" and reading.extra.get("path_by_name"):
            reading.notes.append(f"{key}: known in part ({said}); the MoE rule reads the model's name, which is read")
        else:
            reading.notes.append(f"{key}: its value is known only when the script runs ({said}); no rule reads it")
    if ctx.nproc is None:
        reading.notes += [f"the process count: {shell.readable(w)} (or pass --nproc N)" for w in v.launch]


LAUNCHER = Launcher(
    "verl", "verl", read, markers=MARKERS, strong_markers=STRONG_MARKERS, read_keys=READ_KEYS, rules=RULES
)
"""verl's command lines (`parse_command`) and YAML configs, read by the plugin's model (verl is not imported)."""
