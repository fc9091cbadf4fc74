"""Axolotl YAML configs (`axolotl train cfg.yml`): the plugin's model of Axolotl main@067b021c before the Trainer runs
(`SOURCES`); Axolotl cannot be imported here (its wheels need Python >= 3.12 and pin other transformers/TRL). Its
phases in order: the schema (`_schema`), the validators (`RULES`, `_validators`), `_normalize`, `_builders`; the
use_reentrant each phase writes is a ladder of `schema.Step`s (`VALIDATED`, then `WRITTEN`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..._base.flags import pydantic_bool
from ...core.context_parallel import KEY as CP_KEY
from ...core.context_parallel import cp_size_of
from ..read.common import (
    KWARGS_CHANGES,
    ConfigError,
    Context,
    Fact,
    LauncherRule,
    Origin,
    Reading,
    Reentrant,
    expect_mapping,
    release,
    short,
    type_name,
    where,
)
from ..read.deepspeed import read_deepspeed
from ..read.load import Config
from ..read.model_config import local_model_config, read_model_facts
from .base import Launcher
from .schema import Key, Kind, Step, Values, as_given, checked, read_keys, rewrite
from .trl import read_kwargs_keys

COMMIT = "067b021c8b87a9e5e380b9173c704cf7340e30f5"
VERSION_MODELLED = "Axolotl main@067b021c"
PLUGIN = "trl_gc_plugin.integrations.axolotl.SafeGCPlugin"
"""The `plugins:` entry of the plugin's Axolotl integration (`trl_gc_plugin/integrations/axolotl.py`)."""
SRC = f"https://github.com/axolotl-ai-cloud/axolotl/blob/{COMMIT}/src/axolotl/"
VALIDATION = SRC + "utils/schemas/validation.py"

SOURCES = {
    "schema": (
        f"{SRC}utils/schemas/config.py#L600-L635 (gradient_checkpointing, gradient_checkpointing_kwargs, "
        "selective_checkpointing, activation_offloading)"
    ),
    "normalize": (
        f"{SRC}utils/config/__init__.py#L377-L383 (normalize_config: use_reentrant True for SFT when nothing else "
        "sets it)"
    ),
    "gemma4": (
        f"{SRC}utils/config/__init__.py#L385-L415 (Gemma 4: use_reentrant False, ddp_find_unused_parameters True)"
    ),
    "causal_ddp": f"{SRC}core/builders/causal.py#L262-L268 (SFT: ddp_find_unused_parameters=bool(cfg value) under DDP)",
    "rl_builder": f"{SRC}core/builders/rl.py#L101-L229 (RL: ddp_find_unused_parameters is not passed)",
    "builder_gc": f"{SRC}core/builders/base.py#L581-L610 (_configure_gradient_checkpointing)",
    "input_grads": f"{SRC}loaders/adapter.py#L427-L428 (enable_input_require_grads() for every adapter)",
    "sac": (
        f"{SRC}monkeypatch/selective_checkpointing.py#L317-L326 (selective checkpointing forces use_reentrant=False)"
    ),
    "ac_wrap": (
        f"{SRC}core/trainers/mixins/activation_checkpointing.py#L148-L150 (ac_wrap_hf_model: torch "
        "checkpoint_wrapper, NO_REENTRANT)"
    ),
    "offload_cpu": (
        f"{SRC}monkeypatch/gradient_checkpointing/offload_cpu.py#L38-L68 (legacy offloading: a reentrant-style "
        "autograd Function)"
    ),
    "offload": f"{VALIDATION}#L1426-L1442 (offload -> activation_offloading)",
    "hidden_states": f"{VALIDATION}#L1497-L1515 (hidden_states: use_reentrant defaults to False)",
    "cp_env": "axolotl 0.19.0 utils/trainer.py setup_parallelism_envs: PARALLELISM_CONFIG_CP_SIZE, "
    "ACCELERATE_USE_PARALLELISM_CONFIG",
    "ebft_reentrant": f"{VALIDATION}#L1825-L1843 (EBFT strided + flex_attention forces use_reentrant: true)",
    "fsdp_prefix": f"{VALIDATION}#L1085-L1104 (fsdp_config: the fsdp_ prefix is dropped)",
    "adapter": f"{SRC}utils/schemas/peft.py#L179-L199 (validate_adapter)",
    "selective": f"{VALIDATION}#L1451-L1494 (check_selective_checkpointing)",
}

MARKERS = frozenset(
    {
        "base_model",
        "base_model_config",
        "sequence_len",
        "num_epochs",
        "adapter",
        "lora_target_linear",
        "lora_model_dir",
        "rl",
        "unfrozen_parameters",
        "sample_packing",
        "pad_to_sequence_len",
        "val_set_size",
        "special_tokens",
        "flash_attention",
        "activation_offloading",
        "selective_checkpointing",
        "tokenizer_type",
        "wandb_project",
    }
)
"""Keys only Axolotl's configs use (`base_model` is required by its schema). Not `micro_batch_size`: LLaMA-Factory's
v1 configs use it too."""

STRONG_MARKERS = frozenset({"base_model"})

RL_TYPES = {
    "dpo": "dpo",
    "ipo": "dpo",
    "orpo": "orpo",
    "kto": "kto",
    "simpo": "cpo",
    "grpo": "grpo",
    "gdpo": "grpo",
    "ebft": "grpo",
}
"""Axolotl's `RLType` values (`utils/schemas/enums.py`) and the TRL trainer kind each one runs."""

BUNDLED_DEEPSPEED = {
    "zero1.json": 1,
    "zero1_torch_compile.json": 1,
    "zero2.json": 2,
    "zero2_torch_compile.json": 2,
    "zero3.json": 3,
    "zero3_bf16.json": 3,
    "zero3_bf16_cpuoffload_all.json": 3,
    "zero3_bf16_cpuoffload_params.json": 3,
}
"""Axolotl's `deepspeed_configs/` (copied by `axolotl fetch deepspeed_configs`), with their ZeRO stages."""


@dataclass(frozen=True)
class View:
    """The keys the plugin reads as Axolotl's schema types them (`_schema`), with `gc`, `activation_offloading` and
    `kwargs` as the validators leave them (`_validators`): what the validators that refuse or warn (`RULES`) see."""

    raw: dict[str, Any]
    base_model: str
    gc: Any  # True / False / None; the schema also takes "offload" / "offload_disk", which the validators rewrite
    kwargs: dict[str, Any] | None
    activation_offloading: Any  # True / False / None / "legacy" / "disk" / "hidden_states"
    selective: dict[str, Any] | None
    unfrozen: list[str] | None
    rl: str | None
    adapter: str | None
    load_in_4bit: bool
    load_in_8bit: bool
    gptq: bool
    ddp_flag: bool | None
    find_unused: bool | None
    sample_packing: bool
    attn: Any
    ebft: dict[str, Any] | None
    fsdp_version: int | None
    fsdp: list[str] | None
    fsdp_config: dict[str, Any]
    fsdp_ac: bool
    inference: bool
    merge_lora: bool
    plugins: bool
    n_gpu: int
    gc_detail: str = ""  # set by the validators
    ebft_strided_flex: bool = False

    @property
    def uses_fsdp(self) -> bool:
        return bool(self.fsdp) or bool(self.fsdp_config)

    def raw_kwargs(self) -> dict[str, Any]:
        value = self.raw.get("gradient_checkpointing_kwargs")
        return value if isinstance(value, dict) else {}


def _trl_gc_entries(raw: Any, callbacks: bool) -> list[str]:
    """The `plugins:` entries under `trl_gc_plugin.` that are not the plugin: the callback's path (`callbacks`) or
    anything else."""
    entries = raw.get("plugins") if isinstance(raw.get("plugins"), list) else []
    ours = [e.strip() for e in entries if isinstance(e, str) and e.strip().startswith("trl_gc_plugin.")]
    return [e for e in ours if e != PLUGIN and (e.rsplit(".", 1)[-1] == "SafeGCCallback") == callbacks]


def _matmul_saves(v: View) -> list[str]:
    ops = ("aten::mm", "aten::addmm", "aten::matmul", "aten::bmm")
    save = (v.selective or {}).get("save", ["attention"])
    return [s for s in save if isinstance(s, str) and s != "attention" and any(s in op for op in ops)]


RULES: tuple[LauncherRule, ...] = (
    LauncherRule(
        id="axolotl:unfrozen-needs-non-reentrant",
        action="error",
        setting="use_reentrant",
        condition="`unfrozen_parameters` and `gradient_checkpointing_kwargs.use_reentrant: true`",
        message='Axolotl refuses to start: "`use_reentrant` must be false when used with partially frozen model."',
        change="gradient_checkpointing_kwargs: {use_reentrant: false}",
        evidence=(
            f"{VALIDATION}#L456-L467 (check_use_reentrant_mismatch)",
            "https://github.com/huggingface/transformers/issues/21381",
        ),
        when=lambda v: bool(v.raw.get("unfrozen_parameters")) and v.raw_kwargs().get("use_reentrant") is True,
    ),
    LauncherRule(
        id="axolotl:distributed-rl-qlora-reentrant",
        action="error",
        setting="use_reentrant",
        condition="`rl`, checkpointing, `use_reentrant` true, `load_in_4bit`, `adapter: qlora`, more than one GPU",
        message=(
            'Axolotl refuses to start: "The `use_reentrant: True` implementation of gradient checkpointing is not '
            'supported for distributed RL training with QLoRA." (it counts GPUs from WORLD_SIZE, i.e. --nproc here)'
        ),
        change="gradient_checkpointing_kwargs: {use_reentrant: false}",
        evidence=(f"{VALIDATION}#L718-L739 (check_rl_config_gradient_checkpointing)",),
        when=lambda v: bool(
            v.raw.get("rl")
            and v.raw.get("gradient_checkpointing")
            and v.raw_kwargs().get("use_reentrant")
            and v.raw.get("load_in_4bit")
            and v.raw.get("adapter") == "qlora"
            and v.n_gpu > 1
        ),
    ),
    LauncherRule(
        id="axolotl:fsdp-and-deepspeed",
        action="error",
        setting="deepspeed",
        condition="`deepspeed` and `fsdp` both set",
        message='Axolotl refuses to start: "deepspeed and fsdp cannot be used together."',
        change="keep one of `deepspeed:` / `fsdp:`",
        evidence=(f"{VALIDATION}#L1226-L1229 (check_fsdp_deepspeed)",),
        when=lambda v: bool(v.raw.get("deepspeed") and v.raw.get("fsdp")),
    ),
    LauncherRule(
        id="axolotl:quantized-needs-adapter",
        action="error",
        setting="adapter",
        condition="`load_in_4bit` or `load_in_8bit` without an `adapter` (and not `inference`)",
        message=(
            'Axolotl refuses to start: "load_in_8bit and load_in_4bit are not supported without setting an adapter for '
            'training."'
        ),
        change="set `adapter: lora` (or `qlora`), or turn off load_in_4bit / load_in_8bit",
        evidence=(SOURCES["adapter"],),
        when=lambda v: (
            not v.raw.get("adapter")
            and not v.raw.get("inference")
            and bool(v.raw.get("load_in_8bit") or v.raw.get("load_in_4bit"))
        ),
    ),
    LauncherRule(
        id="axolotl:unknown-adapter",
        action="error",
        setting="adapter",
        condition="`adapter` other than lora / qlora / llama-adapter, and no `plugins:` that could register it",
        message='Axolotl refuses to start: the adapter "is not built in and was not registered by a plugin".',
        change="use `adapter: lora` or `qlora`, or add the plugin that provides the adapter to `plugins:`",
        evidence=(SOURCES["adapter"],),
        when=lambda v: bool(v.adapter) and v.adapter not in ("lora", "qlora", "llama-adapter") and not v.plugins,
    ),
    LauncherRule(
        id="axolotl:qlora-needs-4bit",
        action="error",
        setting="load_in_4bit",
        condition="`adapter: qlora` without `load_in_4bit: true`, or with `load_in_8bit` / `gptq` (not merging)",
        message="Axolotl refuses to start: qlora requires `load_in_4bit: true` and neither 8-bit nor GPTQ loading.",
        change="set `load_in_4bit: true` (and remove load_in_8bit / gptq)",
        evidence=(f"{SRC}utils/schemas/peft.py#L202-L224 (validate_qlora)",),
        when=lambda v: v.adapter == "qlora" and not v.merge_lora and (v.load_in_8bit or v.gptq or not v.load_in_4bit),
    ),
    LauncherRule(
        id="axolotl:offloading-needs-gc",
        action="error",
        setting="gradient_checkpointing",
        condition="`activation_offloading` with checkpointing off",
        message='Axolotl refuses to start: "activation_offloading requires gradient_checkpointing".',
        change="gradient_checkpointing: true (or remove activation_offloading)",
        evidence=(f"{VALIDATION}#L1445-L1448 (check_activation_offloading_wo_gc)",),
        when=lambda v: bool(v.activation_offloading) and not v.gc,
    ),
    LauncherRule(
        id="axolotl:selective-needs-gc",
        action="error",
        setting="gradient_checkpointing",
        condition="`selective_checkpointing` with checkpointing off",
        message='Axolotl refuses to start: "selective_checkpointing requires gradient_checkpointing".',
        change="gradient_checkpointing: true (or remove selective_checkpointing)",
        evidence=(SOURCES["selective"],),
        when=lambda v: v.selective is not None and not v.gc,
    ),
    LauncherRule(
        id="axolotl:selective-needs-non-reentrant",
        action="error",
        setting="use_reentrant",
        condition="`selective_checkpointing` with `gradient_checkpointing_kwargs.use_reentrant` true",
        message='Axolotl refuses to start: "selective_checkpointing requires non-reentrant checkpointing".',
        change="gradient_checkpointing_kwargs: {use_reentrant: false}",
        evidence=(SOURCES["selective"],),
        when=lambda v: v.selective is not None and bool(v.gc) and bool((v.kwargs or {}).get("use_reentrant")),
    ),
    LauncherRule(
        id="axolotl:selective-with-offloading",
        action="error",
        setting="activation_offloading",
        condition="`selective_checkpointing` with `activation_offloading` other than false / hidden_states",
        message=(
            "Axolotl refuses to start: selective checkpointing works only with `activation_offloading: hidden_states` "
            "(or false)."
        ),
        change="activation_offloading: hidden_states (or false)",
        evidence=(SOURCES["selective"],),
        when=lambda v: (
            v.selective is not None
            and bool(v.gc)
            and not (v.kwargs or {}).get("use_reentrant")
            and bool(v.activation_offloading)
            and v.activation_offloading != "hidden_states"
        ),
    ),
    LauncherRule(
        id="axolotl:selective-saves-matmul-with-adapter",
        action="error",
        setting="selective_checkpointing",
        condition="`selective_checkpointing.save` entries that match matmul ops, with an adapter",
        message="Axolotl refuses to start: saved matmul outputs are mutated in place by the adapter.",
        change="selective_checkpointing: {save: [attention]}",
        evidence=(SOURCES["selective"],),
        when=lambda v: (
            v.selective is not None
            and bool(v.gc)
            and bool(v.adapter)
            and bool(_matmul_saves(v))
            and not (v.kwargs or {}).get("use_reentrant")
            and v.activation_offloading in (False, None, "hidden_states")
        ),
    ),
    LauncherRule(
        id="axolotl:hidden-states-reentrant-unfrozen",
        action="error",
        setting="use_reentrant",
        condition="`activation_offloading: hidden_states`, `use_reentrant: true` and `unfrozen_parameters`",
        message=(
            "Axolotl refuses to start: hidden-states offloading with reentrant checkpointing is incompatible with "
            "`unfrozen_parameters`."
        ),
        change="gradient_checkpointing_kwargs: {use_reentrant: false}",
        evidence=(SOURCES["hidden_states"],),
        when=lambda v: (
            v.activation_offloading == "hidden_states"
            and bool((v.kwargs or {}).get("use_reentrant"))
            and bool(v.unfrozen)
        ),
    ),
    LauncherRule(
        id="axolotl:ebft-offloading-flex",
        action="error",
        setting="activation_offloading",
        condition="EBFT strided + `attn_implementation: flex_attention` + `activation_offloading: true`",
        message=(
            "Axolotl refuses to start: activation offloading conflicts with flex_attention's reentrant requirement in "
            "EBFT strided mode."
        ),
        change="remove activation_offloading",
        evidence=(f"{VALIDATION}#L1846-L1863 (check_ebft_activation_offloading)",),
        when=lambda v: v.ebft_strided_flex and v.activation_offloading is True,
    ),
    LauncherRule(
        id="axolotl:mpt-checkpointing",
        action="error",
        setting="gradient_checkpointing",
        condition="`base_model` names an MPT model and checkpointing is on",
        message='Axolotl refuses to start: "gradient_checkpointing is not supported for MPT models".',
        change="gradient_checkpointing: false",
        evidence=(f"{VALIDATION}#L1403-L1408 (check_mpt_checkpointing)",),
        when=lambda v: "mpt" in v.base_model.lower() and bool(v.gc),
    ),
    LauncherRule(
        id="axolotl:nemotron-h-needs-packing",
        action="error",
        setting="gradient_checkpointing",
        condition="`base_model` names a Nemotron-H model, checkpointing on, no `sample_packing`",
        message="Axolotl refuses to start: Nemotron-H checkpointing requires `sample_packing: true`.",
        change="sample_packing: true (or gradient_checkpointing: false)",
        evidence=(f"{VALIDATION}#L1411-L1423 (check_nemotron_h_gradient_checkpointing)",),
        when=lambda v: "nemotron-h" in v.base_model.lower() and bool(v.gc) and not v.sample_packing,
    ),
    LauncherRule(
        id="axolotl:qlora-zero3-warning",
        action="none",
        setting="use_reentrant",
        condition="`adapter: qlora`, `use_reentrant: false` and a `deepspeed` path containing 'zero3'",
        message=(
            'Axolotl only warns: "qlora + zero3 with use_reentrant: false may result in a CheckpointError", and only '
            "when the DeepSpeed path's text contains 'zero3'."
        ),
        evidence=(f"{VALIDATION}#L628-L644 (warn_qlora_zero3_w_use_reentrant)",),
        when=lambda v: (
            v.raw.get("adapter") == "qlora"
            and v.raw_kwargs().get("use_reentrant") is False
            and isinstance(v.raw.get("deepspeed"), (str, dict))
            and "zero3" in v.raw.get("deepspeed", "")
        ),
        disagreement=(
            "the plugin reads the ZeRO stage from the DeepSpeed config itself, and refuses non-reentrant there only "
            "on DeepSpeed < 0.19.3, where the CheckpointError happens (fixed by DeepSpeed PR 8148)."
        ),
    ),
    LauncherRule(
        id="axolotl:sft-defaults-reentrant",
        action="none",
        setting="use_reentrant",
        condition="checkpointing on, no `gradient_checkpointing_kwargs`, no `unfrozen_parameters`, no `rl`",
        message="Axolotl's normalize_config writes gradient_checkpointing_kwargs: {use_reentrant: true}.",
        evidence=(SOURCES["normalize"],),
        when=lambda v: (
            bool(v.gc)
            and v.raw.get("unfrozen_parameters") is None
            and v.raw.get("gradient_checkpointing_kwargs") is None
            and v.rl is None
            and v.activation_offloading != "hidden_states"
            and not v.ebft_strided_flex
        ),
        disagreement=(
            "the plugin prefers non-reentrant (PyTorch's recommendation, correct with frozen inputs) but keeps a "
            "value Axolotl wrote; where a rule requires non-reentrant, strict mode refuses it as it would a value you "
            "set, and the change is `gradient_checkpointing_kwargs: {use_reentrant: false}`."
        ),
    ),
    LauncherRule(
        id="axolotl:rl-ignores-ddp-find-unused",
        action="warn",
        setting="ddp_find_unused_parameters",
        condition="`rl` and `ddp_find_unused_parameters` in the file",
        message=(
            "Axolotl's RL builder does not pass ddp_find_unused_parameters to the trainer, so the file's value has no "
            "effect: transformers decides (True for a PEFT model)."
        ),
        evidence=(SOURCES["rl_builder"],),
        when=lambda v: v.rl is not None and v.raw.get("ddp_find_unused_parameters") is not None,
    ),
    LauncherRule(
        id="axolotl:string-use-reentrant",
        action="none",
        setting="use_reentrant",
        condition="`gradient_checkpointing_kwargs.use_reentrant` is not a boolean (e.g. the string 'false')",
        message=(
            "Axolotl passes the value through unchanged and its validators compare it with `is True` / `is False`, so "
            "they do not see it; torch reads a non-empty string as True."
        ),
        evidence=(SOURCES["schema"],),
        when=lambda v: (
            "use_reentrant" in v.raw_kwargs()
            and not isinstance(v.raw_kwargs()["use_reentrant"], bool)
            and v.raw_kwargs()["use_reentrant"] is not None
        ),
        disagreement=(
            "the plugin reads a string that spells a boolean as that boolean and writes the bool (rule "
            "invalid-use-reentrant)."
        ),
    ),
    LauncherRule(
        id="axolotl:fsdp-checkpointing-and-gc",
        action="none",
        setting="gradient_checkpointing",
        condition="`fsdp_config.activation_checkpointing` and `gradient_checkpointing` both on",
        message=(
            "No Axolotl validator rejects FSDP's activation checkpointing together with gradient_checkpointing (its "
            'examples say "don\'t use with fsdp_activation_checkpointing").'
        ),
        evidence=(f"{VALIDATION}#L1085-L1104 (fsdp_config keys; no check of the pair)",),
        when=lambda v: False,  # added by `read` when the pair is on (it needs the parsed fsdp_config)
        disagreement=(
            "transformers' Trainer refuses the pair (5.23: 'both activation checkpointing options'); the plugin says "
            "so before launch (rule fsdp-activation-checkpointing)."
        ),
    ),
    LauncherRule(
        id="axolotl:plugin-is-a-callback",
        action="error",
        setting="plugins",
        condition="`plugins:` lists `trl_gc_plugin.SafeGCCallback` (a Trainer callback, not an Axolotl plugin)",
        message=(
            "Axolotl stops with \"AttributeError: 'SafeGCCallback' object has no attribute 'register'\": it creates "
            "every `plugins:` entry and calls its register(cfg)."
        ),
        change=f"plugins: [{PLUGIN}]",
        evidence=(f"{SRC}cli/config.py (prepare_plugins); reproduced with Axolotl 0.19.0",),
        when=lambda v: any(_trl_gc_entries(v.raw, callbacks=True)),
    ),
    LauncherRule(
        id="axolotl:plugin-not-found",
        action="warn",
        setting="plugins",
        condition=f"`plugins:` lists a `trl_gc_plugin.` entry that is neither {PLUGIN} nor the callback",
        message=(
            "Axolotl cannot load it: a module that does not exist is logged as an ImportError and the run goes on "
            "without the plugin; a class that does not exist stops it."
        ),
        change=f"plugins: [{PLUGIN}]",
        evidence=(f"{SRC}integrations/base.py (load_plugin, PluginManager.register); read in Axolotl 0.19.0",),
        when=lambda v: any(_trl_gc_entries(v.raw, callbacks=False)),
    ),
)

FORCED_REENTRANT_CHANGE = (
    "EBFT strided mode with flex_attention forces use_reentrant: true in Axolotl, so setting it to false does not "
    "hold: launch with DeepSpeed or FSDP instead of plain DDP, or use another attn_implementation"
)


def _base_model(config: Config) -> str:
    base_model = config.values.get("base_model")
    if not isinstance(base_model, str) or not base_model:
        raise ConfigError(
            f"{where(config.path, 'base_model', config.lines)}: Axolotl requires base_model (a model id or path), got "
            f"{type_name(base_model)} {short(base_model)}"
        )
    return base_model


def _bool(*choices: str, suffix: str = "") -> Kind:
    """A key the schema types as a boolean or one of `choices`."""
    takes = f"true, false, {', '.join(choices[:-1])} or {choices[-1]}" if choices else "true or false"
    return checked(
        lambda v: v in choices or pydantic_bool(v) is not None,
        f"Axolotl's schema takes {takes}, not {{value}}{suffix}",
        lambda v: v if v in choices else pydantic_bool(v),
    )


def _mapping(example: str) -> Kind:
    return lambda config, name, value: dict(expect_mapping(value, config.path, name, config.lines, example))


def _selective(config: Config, name: str, value: Any) -> dict[str, Any] | None:
    """`selective_checkpointing`: a mapping (its `save` a list of op names) or a boolean."""
    if isinstance(value, dict):
        save = value.get("save", ["attention"])
        if not isinstance(save, list) or not all(isinstance(s, str) for s in save):
            raise ConfigError(
                f"{where(config.path, f'{name}.save', config.lines)}: expected a list of op names, got {short(save)}"
            )
        return dict(value)
    flag = pydantic_bool(value)
    if flag is None:
        raise ConfigError(
            f"{where(config.path, name, config.lines)}: Axolotl's schema takes a mapping or true/false, not "
            f"{short(value)}"
        )
    return {"save": ["attention"]} if flag else None


def _fsdp_config(config: Config, name: str, value: Any) -> dict[str, Any]:
    """`fsdp_config` without its `fsdp_` prefixes (check_fsdp_config_kwargs_prefix: `fsdp_activation_checkpointing` ->
    `activation_checkpointing`), which must be a boolean."""
    mapping = expect_mapping(value, config.path, name, config.lines, "{activation_checkpointing: true}")
    out = {(k[5:] if k.startswith("fsdp_") and k != "fsdp_version" else k): v for k, v in mapping.items()}
    ac = out.get("activation_checkpointing")
    if ac is not None and pydantic_bool(ac) is None:
        raise ConfigError(
            f"{where(config.path, f'{name}.activation_checkpointing', config.lines)}: expected true or false, got "
            f"{short(ac)}"
        )
    return out


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


_FLAG = _bool()
_UNFROZEN = checked(_strings, "Axolotl's schema takes a list of parameter-name patterns, got {value}")
_RL = checked(
    lambda v: isinstance(v, str) and v in RL_TYPES, f"not one of Axolotl's RL types ({', '.join(RL_TYPES)}): {{value}}"
)
_ADAPTER = checked(lambda v: isinstance(v, str), "expected a string such as lora or qlora, got {type} {value}")
_WHOLE = checked(lambda v: isinstance(v, int) and not isinstance(v, bool), "expected a whole number, got {value}")
_FSDP = checked(_strings, "Axolotl's schema takes a list of FSDP options (deprecated: use fsdp_config), got {value}")
KEYS = (  # the keys the schema types after base_model, in its order (a null is unset: `_schema`)
    Key("gc", ("gradient_checkpointing",), _bool("offload", "offload_disk", suffix="; Axolotl refuses to start")),
    Key("kwargs", ("gradient_checkpointing_kwargs",), _mapping("{use_reentrant: false}")),
    Key("activation_offloading", ("activation_offloading",), _bool("legacy", "disk", "hidden_states")),
    Key("selective", ("selective_checkpointing",), _selective),
    Key("unfrozen", ("unfrozen_parameters",), _UNFROZEN),
    Key("rl", ("rl",), _RL),
    Key("adapter", ("adapter",), _ADAPTER),
    Key("load_in_4bit", ("load_in_4bit",), _FLAG, False),
    Key("load_in_8bit", ("load_in_8bit",), _FLAG, False),
    Key("gptq", ("gptq",), _FLAG, False),
    Key("ddp_flag", ("ddp",), _FLAG),
    Key("find_unused", ("ddp_find_unused_parameters",), _FLAG),
    Key("sample_packing", ("sample_packing",), _FLAG, False),
    Key("attn", ("attn_implementation",), as_given),
    Key("ebft", ("ebft",), _mapping("{mode: strided}")),
    Key("fsdp_version", ("fsdp_version",), _WHOLE),
    Key("fsdp", ("fsdp",), _FSDP),
    Key("fsdp_config", ("fsdp_config",), _fsdp_config, {}),
    Key("inference", ("inference",), _FLAG, False),
    Key("merge_lora", ("merge_lora",), _FLAG, False),
)

READ_KEYS = frozenset(
    {
        *(name for key in KEYS for name in key.names),
        *("base_model", "context_parallel_size", "sequence_parallel_degree", "plugins", "deepspeed", "fp8"),
    }
)


def _schema(config: Config, world: int) -> View:
    """Phase 1: the schema's typed parsing (ConfigError where Axolotl's pydantic model fails), in its order:
    `base_model`, then `KEYS`."""
    base_model = _base_model(config)
    k = read_keys(config, KEYS, absent=[name for name, value in config.values.items() if value is None])
    ac = k.fsdp_config.get("activation_checkpointing")
    return View(
        raw=dict(config.values),
        base_model=base_model,
        **{key.field: k[key.field] for key in KEYS},
        fsdp_ac=False if ac is None else pydantic_bool(ac),
        plugins=bool(config.values.get("plugins")),
        n_gpu=world,
    )


VALIDATED = (  # the validators' rewrites (mode="after") of the kwargs: what `RULES` see
    Step(
        lambda v, kw: v.activation_offloading == "hidden_states" and "use_reentrant" not in (kw.kwargs or {}),
        False,
        "activation_offloading: hidden_states defaults use_reentrant to false ({src[hidden_states]})",
        kwargs=True,
    ),
    Step(
        lambda v, kw: v.ebft_strided_flex and v.gc and not (kw.kwargs or {}).get("use_reentrant"),
        True,
        "EBFT strided + flex_attention forces use_reentrant: true ({src[ebft_reentrant]})",
        kwargs=True,
    ),
)

WRITTEN = (  # normalize_config's rewrites of the kwargs, then the use_reentrant the trainer builders pass
    Step(
        lambda v, kw: v.gc and v.unfrozen is None and kw.kwargs is None and v.rl is None,
        True,
        "Axolotl normalize_config writes {{use_reentrant: true}} ({src[normalize]})",
        kwargs=True,
    ),
    Step(
        lambda v, kw: v.gemma4 and v.gc and (kw.kwargs or {}).get("use_reentrant") is not False,
        False,
        "Gemma 4: Axolotl forces use_reentrant false ({src[gemma4]})",
        kwargs=True,
    ),
    Step(
        lambda v, _: v.wrapped,
        False,
        "activation_offloading {activation_offloading!r} on a full fine-tune: torch checkpoint_wrapper, "
        "non-reentrant ({src[ac_wrap]})",
    ),
    Step(
        lambda v, _: v.adapter and v.activation_offloading == "legacy",
        True,
        "activation_offloading: legacy runs Axolotl's CPU-offloading checkpoint, reentrant-style ({src[offload_cpu]})",
    ),
    Step(
        lambda v, kw: (
            v.adapter and v.activation_offloading not in (None, False, "hidden_states", "legacy") and kw.value is None
        ),
        lambda v: v.tf_below_5,
        "adapter + activation_offloading: the load-time checkpointing without use_reentrant takes transformers' "
        "default",
        "launcher default",
    ),
    Step(
        lambda v, kw: not v.activation_offloading and v.gc and kw.kwargs is None,
        False,
        "Axolotl's builder passes {{use_reentrant: false}} when no kwargs are set ({src[builder_gc]})",
    ),
    Step(
        lambda v, _: v.selective is not None and v.gc,
        False,
        "selective_checkpointing patches the model to non-reentrant ({src[sac]})",
    ),
)
GEMMA4 = ("gemma4", "gemma4_unified")
"""The `model_type`s of Axolotl's Gemma 4 rewrites."""


def _validators(s: View, kw: Reentrant, reading: Reading) -> View:
    """Phase 2: the validators' rewrites (mode="after") of checkpointing, offloading and use_reentrant."""
    gc, offloading = s.gc, s.activation_offloading
    gc_detail = "key 'gradient_checkpointing'" if "gradient_checkpointing" in s.raw else "Axolotl's default: false"
    if gc in ("offload", "offload_disk"):  # SOURCES["offload"]
        offloading = True if gc == "offload" else "disk"
        gc_detail = (
            f"gradient_checkpointing: {gc} -> true + activation_offloading: {'true' if gc == 'offload' else 'disk'} "
            "(Axolotl validator)"
        )
        gc = True
    ebft_strided_flex = bool(s.rl == "ebft" and (s.ebft or {}).get("mode") == "strided" and s.attn == "flex_attention")
    if ebft_strided_flex and gc:
        reading.extra["forced"] = {"use_reentrant": FORCED_REENTRANT_CHANGE}
    v = replace(s, gc=gc, gc_detail=gc_detail, activation_offloading=offloading, ebft_strided_flex=ebft_strided_flex)
    return replace(v, kwargs=rewrite(VALIDATED, Values(vars(v), src=SOURCES), kw).kwargs)


def _normalize(v: View, model_type: str | None, reading: Reading) -> tuple[bool, bool | None]:
    """Phase 3: normalize_config's `cfg.ddp` (every multi-process run) and `ddp_find_unused_parameters` (its
    use_reentrant rewrites are `WRITTEN`'s)."""
    ddp = v.ddp_flag if v.ddp_flag is not None else v.n_gpu != 1
    find_unused = v.find_unused
    if model_type in GEMMA4 and ddp and find_unused is None and v.activation_offloading is not True:
        find_unused = True
        reading.notes.append(f"Gemma 4 under DDP: Axolotl sets ddp_find_unused_parameters: true ({SOURCES['gemma4']})")
    return ddp, find_unused


def _builders(v: View, kw: Reentrant, model_type: str | None, ctx: Context, reading: Reading) -> None:
    """Phases 3 and 4: normalize_config's and the trainer builders' use_reentrant (`WRITTEN`), and what else they
    set."""
    tf = ctx.versions.get("transformers") or "5"
    wrapped = bool(v.activation_offloading and v.activation_offloading != "hidden_states" and not v.adapter)
    below_5, gemma4 = tf.split(".")[0].isdigit() and int(tf.split(".")[0]) < 5, model_type in GEMMA4
    rewrite(WRITTEN, Values(vars(v), gemma4=gemma4, wrapped=wrapped, tf_below_5=below_5, src=SOURCES), kw)
    if wrapped:
        reading.set("checkpoint_wrapped", True, "launcher rewrite", f"ac_wrap_hf_model ({SOURCES['ac_wrap']})")
    if v.selective is not None and v.gc:
        reading.set("selective", True, "file", "key 'selective_checkpointing'")
    if pydantic_bool(v.raw.get("fp8")) is True:  # torchao's Float8Linear (rule `fp8-checkpointing`)
        reading.set("fp8", "Axolotl fp8: true (torchao Float8Linear)", "file", "key 'fp8'")


def _gc_facts(v: View, kw: Reentrant, reading: Reading) -> None:
    reentrant, given = kw.value, "gradient_checkpointing" in v.raw
    reading.set("gc_enabled", bool(v.gc), "file" if given else "launcher default", v.gc_detail)
    reading.set("gc_flag_source", "user" if given else "unset", "file", v.gc_detail)
    if reentrant is None:
        reading.set("use_reentrant", None, "file", "no use_reentrant")
        reading.set("use_reentrant_source", "unset", kw.origin, kw.detail)
    else:
        reading.set("use_reentrant", reentrant, kw.origin, kw.detail)
        written = "written by Axolotl into the trainer's arguments: the plugin treats it as a value set explicitly"
        reading.set("use_reentrant_source", kw.source, kw.origin, kw.detail if kw.origin == "file" else written)
    reading.set("kwargs_given", kw.kwargs is not None or reentrant is not None, kw.origin, kw.detail)
    if v.activation_offloading:
        reading.set(
            "activation_offloading",
            v.activation_offloading,
            "file",
            "Axolotl's activation offloading (not transformers' `offload` kwarg)",
        )
    if kw.kwargs:
        read_kwargs_keys(reading, kw.kwargs, "gradient_checkpointing_kwargs")


def _model_facts(s: View, ctx: Context, reading: Reading) -> None:
    peft = bool(s.adapter)
    quant = "bitsandbytes_4bit" if s.load_in_4bit else "bitsandbytes_8bit" if s.load_in_8bit else None
    quant = quant or ("gptq" if s.gptq else None)
    grads: bool | None = True
    origin: Origin = "launcher rewrite"
    if peft:
        detail = f"Axolotl calls enable_input_require_grads() for every adapter ({SOURCES['input_grads']})"
    elif s.unfrozen is None:
        origin, detail = "file", "full fine-tune: the embeddings train"
    elif release(ctx.versions.get("transformers"))[0] >= 5:
        detail = "transformers >= 5 hooks the input embeddings when it enables checkpointing"
    else:
        grads, origin = None, "assumed"
        detail = "unfrozen_parameters decides whether the embeddings train; settled at the first forward"
    reading.set_model(
        peft=Fact(
            peft,
            "file" if "adapter" in s.raw else "launcher default",
            f"adapter: {s.adapter}" if s.adapter else "no adapter (full fine-tune)",
        ),
        quant=Fact(quant, "file", "load_in_4bit / load_in_8bit / gptq"),
        frozen=Fact(
            peft or s.unfrozen is not None or quant is not None, "file", "adapter / unfrozen_parameters / quantization"
        ),
        blocks="a config trains the decoder blocks (full, partially or through adapters)",
        grads=Fact(grads, origin, detail),
    )


def _parallel_facts(config: Config, s: View, ddp: bool, find_unused: bool | None, reading: Reading) -> None:
    path, lines, raw = config.path, config.lines, config.values
    ds_value = raw.get("deepspeed")
    if ds_value is not None and not isinstance(ds_value, (str, dict)):
        raise ConfigError(
            f"{where(path, 'deepspeed', lines)}: Axolotl's schema takes a path or a mapping, got {type_name(ds_value)} "
            f"{short(ds_value)}"
        )
    if ds_value:
        read_deepspeed(
            ds_value, path, "deepspeed", config.base_dir, BUNDLED_DEEPSPEED, "deepspeed_configs/", lines
        ).set_facts(reading)
    else:
        reading.set("zero_stage", None, "file", "no deepspeed key")
    reading.set("fsdp", s.uses_fsdp, "file", "fsdp / fsdp_config")
    if s.uses_fsdp:  # check_fsdp_version_in_fsdp_config: fsdp_version, else fsdp_config's, else 1
        version = raw.get("fsdp_version") or s.fsdp_config.get("fsdp_version") or s.fsdp_config.get("version") or 1
        reading.set(
            "fsdp_version",
            version,
            "file" if version != 1 or raw.get("fsdp_version") else "launcher default",
            f"fsdp_version ({VALIDATION}#L1107-L1124)",
        )
    reading.set(
        "fsdp_activation_checkpointing",
        s.uses_fsdp and s.fsdp_ac,
        "file",
        f"fsdp_config.activation_checkpointing ({SOURCES['fsdp_prefix']})",
    )
    # ddp_find_unused_parameters as the SFT builder passes it (the RL builder passes nothing)
    value = bool(find_unused) if s.rl is None and ddp else None
    origin: Origin = "launcher rewrite"
    if s.rl is not None:
        detail = f"Axolotl's RL builder does not pass it: transformers decides ({SOURCES['rl_builder']})"
    elif not ddp:
        detail = f"one process: Axolotl passes None ({SOURCES['causal_ddp']})"
    elif raw.get("ddp_find_unused_parameters") is not None:
        origin, detail = "file", "key 'ddp_find_unused_parameters'"
    else:
        detail = f"Axolotl's SFT builder passes False under DDP when unset ({SOURCES['causal_ddp']})"
    reading.set("ddp_find_unused_parameters", value, origin, detail)
    reading.set("ddp_static_graph", None, "launcher default", "Axolotl does not pass ddp_static_graph")
    # `context_parallel_size` (or the deprecated `sequence_parallel_degree`, which `check_context_parallel_size` copies
    # into it): `setup_parallelism_envs` exports it as accelerate's `PARALLELISM_CONFIG_CP_SIZE`
    key = "context_parallel_size" if raw.get("context_parallel_size") else "sequence_parallel_degree"
    size = cp_size_of({CP_KEY: raw[key]}) if raw.get(key) else 1
    if size is None:
        raise ConfigError(f"{where(path, key, lines)}: Axolotl's schema takes a whole number, got {short(raw[key])}")
    if size > 1:
        reading.set("cp_size", size, "file", f"key {key!r} ({SOURCES['cp_env']})")


def read(config: Config, ctx: Context) -> Reading:
    """The plugin's model of what Axolotl does with `config` (see the module docstring)."""
    reading = Reading(
        format="axolotl",
        parser=f"the plugin's model of {VERSION_MODELLED} (Axolotl is not imported)",
        changes=dict(KWARGS_CHANGES),
    )
    world = reading.set_world_size(  # sets facts only: the schema's errors come first all the same
        ctx,
        "no --nproc: 1 process (`axolotl train` starts one per visible GPU; pass --nproc N)",
        option="--nproc (Axolotl reads WORLD_SIZE)",
    )
    if ctx.trainer is not None:
        reading.notes.append(
            f"--trainer {ctx.trainer} is ignored: an Axolotl config says its trainer itself (`rl:`, else SFT)"
        )
    s = _schema(config, world)
    given = (s.kwargs or {}).get("use_reentrant")
    kw = Reentrant(given, "file", "key 'gradient_checkpointing_kwargs.use_reentrant'", s.kwargs)
    v = _validators(s, kw, reading)
    model_type = _model_type(v.base_model, reading)
    ddp, find_unused = _normalize(v, model_type, reading)
    _builders(v, kw, model_type, ctx, reading)
    _gc_facts(v, kw, reading)
    _model_facts(v, ctx, reading)
    if v.rl:  # `rl:` names a TRL trainer, else Axolotl's SFT trainer
        reading.set_trainer(RL_TYPES[v.rl], "file", f"rl: {v.rl}")
    else:
        reading.set_trainer("sft", "launcher default", "no rl", kind_detail="no rl: Axolotl's SFT trainer")
    _parallel_facts(config, v, ddp, find_unused, reading)
    reading.apply(RULES, v, VERSION_MODELLED, v.raw)
    if v.uses_fsdp and v.fsdp_ac and v.gc:  # the FSDP-checkpointing pair `RULES` cannot see
        rule = next(r for r in RULES if r.id == "axolotl:fsdp-checkpointing-and-gc")
        reading.decisions.append(rule.decision(VERSION_MODELLED, before=True))
    return reading


def _model_type(base_model: str, reading: Reading) -> str | None:
    """`model_type` as Axolotl reads it for its Gemma 4 rewrite: from a local model directory's config.json (which
    also gives the model facts); for a Hub id (the check downloads nothing), `gemma4` when the name says Gemma 4,
    with a note saying it was assumed."""
    if local_model_config(base_model) is not None:
        return read_model_facts(base_model, "base_model", reading)
    compact = base_model.lower().replace("-", "").replace("_", "")
    if "gemma4" in compact:
        reading.notes.append(
            f"base_model {base_model!r}: assumed to be Gemma 4 from its name (Axolotl reads model_type from the "
            "model's config.json, which the check does not download): Axolotl forces use_reentrant: false and, under "
            "DDP, ddp_find_unused_parameters: true"
        )
        return "gemma4"
    return None


NO_OWN_PARSER = (
    "the check does not run Axolotl's own validation, whether Axolotl is installed or not: it imports what the config "
    "names (its `plugins:`, custom dataset and prompt-strategy modules, remote model code), code from the file, which "
    "a check before launch must not run; the file is read by the plugin's model of Axolotl main@067b021c"
)
"""Why `--parser launcher` is refused for Axolotl configs."""


LAUNCHER = Launcher(
    "axolotl",
    "Axolotl",
    read,
    markers=MARKERS,
    strong_markers=STRONG_MARKERS,
    read_keys=READ_KEYS,
    rules=RULES,
    no_parser=NO_OWN_PARSER,
)
"""Axolotl's configs, read by the plugin's model only."""
