"""Read `Facts` off real `TrainingArguments` and models: the only module that knows where transformers, TRL, PEFT and
bitsandbytes keep things (imported lazily, only when a model is inspected)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from .._base.flags import parse_flag
from .._base.weak import WeakIdMap
from ..core import capabilities
from ..core.context_parallel import cp_size_from_args
from ..core.deepspeed_config import ACCELERATE_DEFAULT_STAGE, DeepSpeedFacts
from ..core.deepspeed_config import deepspeed_facts as read_deepspeed_config
from ..core.facts import GENERATING_TRAINERS, RL_TRAINERS, Facts, Source
from ..core.kwargs import checkpoint_kwargs_problem, unknown_checkpoint_keys
from . import ckpt

logger = logging.getLogger("trl_gc_plugin")

NEW_KWARGS, OLD_KWARGS = "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"
NEW_FLAG, OLD_FLAG = "activation_checkpointing", "gradient_checkpointing"

# Forward hooks on the input embeddings that make their output require grad, found by the function's name. Two names,
# one letter apart, both meant: `make_inputs_require_grads` is transformers' (`enable_input_require_grads`),
# `make_inputs_require_grad` PEFT's and TRL's own fallback. Do not "fix" either spelling.
INPUT_GRAD_HOOK_NAMES = frozenset({"make_inputs_require_grads", "make_inputs_require_grad"})


@dataclass
class PostInitRecord:
    """What the plugin saw and did about one `TrainingArguments` object, kept in `RECORDS`, outside it (the Trainer
    pickles the arguments into every checkpoint)."""

    user_given: bool = False  # the user's kwargs had a `use_reentrant` key at construction
    user_value: Any = None
    value: Any = None  # the `use_reentrant` in force after the plugin's last look, and who chose it
    value_source: str | None = None
    new_id: int | None = None  # `id()` of the two kwargs objects (to tell which one was assigned later)
    old_id: int | None = None
    decisions: list[Any] = field(default_factory=list)


RECORDS: WeakIdMap[PostInitRecord] = WeakIdMap()


def start_record(args: Any, user_given: bool, user_value: Any) -> PostInitRecord:
    """A fresh record for `args` (called when the arguments are built)."""
    record = PostInitRecord(user_given=user_given, user_value=user_value)
    RECORDS.set(args, record)
    return record


def remember(args: Any, value: Any, source: str) -> PostInitRecord:
    """Record the `use_reentrant` now in force for `args`, who chose it, and which objects the kwargs fields hold."""
    record = get_record(args) or start_record(args, False, None)
    record.value, record.value_source = value, source
    record.new_id = id(getattr(args, NEW_KWARGS, None))
    record.old_id = id(getattr(args, OLD_KWARGS, None))
    return record


def get_record(args: Any) -> PostInitRecord | None:
    return RECORDS.get(args)


def has_activation_fields(args: Any) -> bool:
    """transformers >= 5.23: `activation_checkpointing*` are the real fields."""
    return NEW_KWARGS in getattr(type(args), "__dataclass_fields__", {})


def kwargs_field(args: Any) -> str:
    """The kwargs field the Trainer reads."""
    return NEW_KWARGS if has_activation_fields(args) else OLD_KWARGS


def flag_field(args: Any) -> str:
    """The on/off field the Trainer reads."""
    return NEW_FLAG if has_activation_fields(args) else OLD_FLAG


def read_kwargs(args: Any) -> dict[str, Any] | None:
    value = getattr(args, kwargs_field(args), None)
    return value if isinstance(value, dict) else None


def trainer_kind(args: Any) -> str:
    """`sft`, `dpo`, `grpo`, `online_dpo`... from the args class name (`TrainingArguments` -> `trainer`)."""
    name = type(args).__name__
    if not name.endswith("Config"):
        return "trainer"
    return re.sub(r"(?<=[^A-Z])(?=[A-Z])", "_", name.removesuffix("Config")).lower() or "trainer"


def world_size(args: Any = None) -> int:
    """Processes of the launch: the launcher's `WORLD_SIZE` (set by torchrun / accelerate / deepspeed), else the
    args' distributed state (`args` None: 1; pass them only once the Trainer exists: reading it during
    `__post_init__` could set up devices early)."""
    value = os.environ.get("WORLD_SIZE", "")
    if value.isdigit():
        return int(value)
    try:
        return int(getattr(args, "world_size", 1) or 1)
    except Exception:
        return 1


def _deepspeed_config(args: Any) -> dict[str, Any] | None:
    """The DeepSpeed config as a dict: from the args (dict, JSON path, or the parsed `hf_deepspeed_config`), or from
    accelerate's environment (`accelerate launch --use_deepspeed` / a DeepSpeed accelerate config)."""
    hf = getattr(args, "hf_deepspeed_config", None)
    if hf is not None and isinstance(getattr(hf, "config", None), dict):
        return hf.config
    value = getattr(args, "deepspeed", None)
    if isinstance(value, dict):
        return value
    path = value if isinstance(value, str) and value else os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                loaded = json.load(fh)
            return loaded if isinstance(loaded, dict) else None
        except (OSError, ValueError):
            return None
    return None


def _plugin_stage(args: Any) -> int | None:
    """The stage in accelerate's `DeepSpeedPlugin` (TrainingArguments builds it; it fills a stage `"auto"`)."""
    stage = getattr(getattr(args, "deepspeed_plugin", None), "zero_stage", None)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3 else None


def _env_stage() -> int | None:
    env_stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
    return int(env_stage) if env_stage.isdigit() and int(env_stage) <= 3 else None


def deepspeed_facts(args: Any) -> DeepSpeedFacts | None:
    """The DeepSpeed config's facts (`_deepspeed.deepspeed_facts`, the reading `trl-gc-check` shares), or None without
    a config. A stage `"auto"` is the plugin's stage, else accelerate's (`ACCELERATE_DEEPSPEED_ZERO_STAGE`, else 2).
    Problems (values DeepSpeed would refuse) are logged once each; the run fails on them in DeepSpeed, not here."""
    config = _deepspeed_config(args)
    if config is None:
        return None
    auto = next((s for s in (_plugin_stage(args), _env_stage()) if s is not None), ACCELERATE_DEFAULT_STAGE)
    facts = read_deepspeed_config(config, auto_stage=auto)
    for problem in facts.problems:
        if problem not in _LOGGED_PROBLEMS:
            _LOGGED_PROBLEMS.add(problem)
            logger.warning("DeepSpeed config: %s", problem)
    return facts


_LOGGED_PROBLEMS: set[str] = set()


def zero_stage(args: Any) -> int | None:
    """The DeepSpeed ZeRO stage in use, or None without DeepSpeed (or when the config's stage is unreadable)."""
    stage = _plugin_stage(args)
    if stage is not None:
        return stage
    ds = deepspeed_facts(args)
    if ds is not None:
        return ds.stage
    if parse_flag(os.environ.get("ACCELERATE_USE_DEEPSPEED", "")):
        return _env_stage() or 0
    return None


def fsdp_facts(args: Any) -> tuple[bool, bool]:
    """(FSDP asked for, FSDP's own activation checkpointing on), from the args or accelerate's environment."""
    fsdp = getattr(args, "fsdp", None)
    on = bool(fsdp) or bool(parse_flag(os.environ.get("ACCELERATE_USE_FSDP", "")))
    config = getattr(args, "fsdp_config", None) or {}
    ac = config.get("activation_checkpointing") if isinstance(config, dict) else None
    if ac is None:
        ac = os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "")
    return on, bool(parse_flag(str(ac)))


def fsdp_version(args: Any) -> int | None:
    """1 or 2: transformers 5.23 reads `fsdp_config["version"]` (default 2); 4.x the `FSDP_VERSION` variable (1)."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if isinstance(plugin_args, dict) and str(plugin_args.get("fsdp_version", "")).isdigit():
        return int(plugin_args["fsdp_version"])
    config = getattr(args, "fsdp_config", None)
    if isinstance(config, dict) and str(config.get("version", "")).isdigit():
        return int(config["version"])
    env = os.environ.get("FSDP_VERSION", "")
    return int(env) if env.isdigit() else 1


def fsdp_applied(args: Any) -> bool | None:
    """Whether accelerate really runs FSDP (its state, which the Trainer sets up in `__init__`): False when it fell
    back to another wrapper (DDP on CPU, `MULTI_CPU`); None when unknown (the state does not exist yet)."""
    state = args.__dict__.get("distributed_state")
    kind = getattr(state, "distributed_type", None)
    if kind is None:
        return None
    name = str(getattr(kind, "value", kind)).rsplit(".", 1)[-1].upper()
    return name == "FSDP" or "XLA" in name


def _flag_source(args: Any) -> Source:
    """Who set the checkpointing flag: on, `trainer` when the config class defaults it on (TRL's configs), else
    `user`; off, `user` when the class defaults it on (someone turned it off), else `unset` (the default)."""
    field_ = getattr(type(args), "__dataclass_fields__", {}).get(OLD_FLAG)
    default = getattr(field_, "default", None)
    on = bool(getattr(args, flag_field(args), False))
    if not on:
        return "user" if default is True else "unset"
    return "trainer" if default is True else "user"


def facts_from_args(args: Any, stage: str = "post_init") -> Facts:
    new_fields = has_activation_fields(args)
    kwargs = getattr(args, kwargs_field(args), None)
    gc_on = bool(getattr(args, flag_field(args), False))
    record = get_record(args)
    use_reentrant = kwargs.get("use_reentrant") if isinstance(kwargs, dict) else None

    disagree = False
    legacy_kwargs: dict[str, Any] | None = None
    legacy_gc: bool | None = None
    changed: str | None = None
    if new_fields:
        old_kwargs = getattr(args, OLD_KWARGS, None)
        old_flag = getattr(args, OLD_FLAG, None)
        if old_kwargs is not kwargs and old_kwargs != kwargs:
            disagree = True
            legacy_kwargs = dict(old_kwargs) if isinstance(old_kwargs, dict) else None
        if old_flag is not None and bool(old_flag) != gc_on:
            disagree = True
            legacy_gc = bool(old_flag)
        if disagree and record is not None and record.new_id is not None:
            moved = (id(old_kwargs) != record.old_id, id(kwargs) != record.new_id)
            changed = {(True, False): "legacy", (False, True): "new"}.get(moved)
        gc_on = gc_on or bool(old_flag)

    fsdp, fsdp_ac = fsdp_facts(args)
    applied = fsdp_applied(args) if fsdp and stage != "post_init" else None
    kind = trainer_kind(args)
    given = kwargs if isinstance(kwargs, dict) else {}
    every = given.get("every_n_layers")
    ds = deepspeed_facts(args)
    offloading = parse_flag(getattr(args, "activation_offloading", None)) is True  # TRL's configs
    return Facts(
        stage=stage,  # type: ignore[arg-type]
        versions=dict(capabilities.installed_versions()),
        capabilities=capabilities.installed(),
        gc_enabled=gc_on,
        use_reentrant=use_reentrant,
        use_reentrant_source=_source(use_reentrant, record),
        kwargs_given=isinstance(kwargs, dict),
        has_activation_fields=new_fields,
        fields_disagree=disagree,
        legacy_kwargs=legacy_kwargs,
        legacy_gc=legacy_gc,
        changed_field=changed,  # type: ignore[arg-type]
        trainer_kind=kind,
        generates=kind in GENERATING_TRAINERS,
        rl_trainer=kind in RL_TRAINERS,
        world_size=world_size(None if stage == "post_init" else args),
        zero_stage=zero_stage(args),
        fsdp=fsdp and applied is not False,
        fsdp_activation_checkpointing=fsdp_ac and applied is not False,
        fsdp_wrapped=applied,
        fsdp_version=fsdp_version(args) if fsdp else None,
        zero_overlap_comm=ds.overlap_comm if ds is not None else None,
        ddp_find_unused_parameters=getattr(args, "ddp_find_unused_parameters", None),
        ddp_static_graph=getattr(args, "ddp_static_graph", None),
        cp_size=cp_size_from_args(args),
        gc_flag_source=_flag_source(args),
        kwargs_keys=tuple(sorted(str(k) for k in given if k != "use_reentrant")),
        kwargs_problem=checkpoint_kwargs_problem(kwargs),
        kwargs_unknown=unknown_checkpoint_keys(given),
        every_n_layers=every if isinstance(every, int) and not isinstance(every, bool) else None,
        offload=bool(parse_flag(given.get("offload", False))),
        preserve_rng_state=parse_flag(given["preserve_rng_state"]) if "preserve_rng_state" in given else None,
        selective="context_fn" in given or bool(parse_flag(given.get("selective", False))),
        deepspeed_activation_checkpointing=ds is not None and ds.activation_checkpointing,
        trl_activation_offloading=offloading,
        accelerator=accelerator_usable() if offloading else None,
        mixed_precision=bool(parse_flag(getattr(args, "bf16", False)) or parse_flag(getattr(args, "fp16", False))),
    )


def _source(value: Any, record: PostInitRecord | None) -> Source:
    if value is None:
        return "unset"
    if record is None:
        return "unknown"
    if record.value_source is not None and value == record.value:
        return record.value_source  # type: ignore[return-value]
    if record.user_given and value == record.user_value:
        return "user"
    return "trainer"


def _source_without_record(facts: Facts, peft: bool) -> Source:
    """Who wrote a `use_reentrant` found in the arguments when the plugin did not see them being built (only the
    callback is used): transformers' own `Trainer` never writes it, so it is the user's; TRL's trainers write it in
    their `__init__` in two known cases (transformers < 5: `setdefault("use_reentrant", False)`; PEFT + DeepSpeed
    ZeRO-3: `True`), so a value equal to what TRL would write there is the trainer's, anything else the user's."""
    if facts.trainer_kind == "trainer":
        return "user"
    if facts.use_reentrant is False and facts.caps.none_kwargs_reentrant:
        return "trainer"
    if facts.use_reentrant is True and peft and facts.zero_stage == 3:
        return "trainer"
    return "user"


def compiled(args: Any, model: Any) -> str | None:
    """Why the model's forward runs under `torch.compile`, or None: the arguments' `torch_compile` (the Trainer
    compiles it through accelerate), accelerate's `ACCELERATE_DYNAMO_BACKEND`, a model compiled in place
    (`nn.Module.compile`) or wrapped by `torch.compile` before the Trainer saw it."""
    if getattr(args, "torch_compile", False):
        return "torch_compile=True"
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "")
    if backend and backend.lower() != "no":
        return f"ACCELERATE_DYNAMO_BACKEND={backend}"
    for candidate in (model, ckpt.unwrap(model)):
        if hasattr(candidate, "_orig_mod"):
            return "the model is wrapped by torch.compile"
        if getattr(candidate, "_compiled_call_impl", None) is not None:
            return "the model was compiled in place (Module.compile)"
    return None


def is_peft_model(model: Any) -> bool:
    return type(model).__module__.split(".")[0] == "peft" or hasattr(model, "peft_config")


def block_pattern(model: Any) -> tuple[bool, ...]:
    """The live per-block checkpointing flags (one per `GradientCheckpointingLayer`, in module order)."""
    return tuple(getattr(b, "gradient_checkpointing", False) is True for b in ckpt.blocks(ckpt.unwrap(model)))


def checkpointing_on(model: Any) -> bool:
    """Some module of the model has checkpointing switched on (any format, the pre-4.35 one included)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in ckpt.unwrap(model).modules())


def input_grad_hooks(model: Any) -> int:
    return len(input_grad_hook_keys(embeddings(model)))


def input_grad_hook_keys(embeddings: Any) -> list[int]:
    if embeddings is None:
        return []
    return [k for k, h in embeddings._forward_hooks.items() if getattr(h, "__name__", "") in INPUT_GRAD_HOOK_NAMES]


def embeddings(model: Any, side: str = "input") -> Any:
    """The model's input (or `side="output"`: output) embeddings under any wrapper, None when it has none."""
    try:
        return getattr(ckpt.unwrap(model), f"get_{side}_embeddings")()
    except (AttributeError, NotImplementedError):
        return None


def model_configs(model: Any) -> list[Any]:
    """Every config object the model's modules read (those of sub-models too: a VLM's text config), each once."""
    configs = (getattr(module, "config", None) for module in ckpt.unwrap(model).modules())
    return list({id(c): c for c in configs if c is not None and hasattr(c, "use_cache")}.values())


def training_use_cache(args: Any, model: Any) -> bool:
    """Whether some config the model reads will have `use_cache=True` while training: transformers >= 5 has a
    `TrainingArguments.use_cache` (default False) that the Trainer writes into the top-level config after
    `on_init_end`; sub-model configs (a VLM's `text_config`, ...) keep their own value."""
    base = ckpt.unwrap(model)
    top = getattr(base, "config", None)
    has_field = "use_cache" in getattr(type(args), "__dataclass_fields__", {})
    return any(
        bool(args.use_cache) if (config is top and has_field) else getattr(config, "use_cache", False) is True
        for config in model_configs(base)
    )


def quantization_of(model: Any) -> str | None:
    base = ckpt.unwrap(model)
    if getattr(base, "is_loaded_in_4bit", False):
        return "bitsandbytes_4bit"
    if getattr(base, "is_loaded_in_8bit", False):
        return "bitsandbytes_8bit"
    qconfig = getattr(getattr(base, "config", None), "quantization_config", None)
    if qconfig is None:
        return None
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else getattr(qconfig, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def _will_add_input_hook(base: Any, facts: Facts) -> bool:
    """transformers >= 5.0 calls `enable_input_require_grads()` itself when it enables checkpointing on a model
    whose `main_input_name` is `input_ids` (and 4.x only for adapters it loaded itself)."""
    if getattr(base, "_hf_peft_config_loaded", False):
        return True
    return bool(facts.caps.enable_adds_input_hook) and getattr(base, "main_input_name", None) == "input_ids"


def _nothing_upstream(model: Any, base: Any, blocks: list[Any]) -> bool:
    """Whether the blocks' inputs certainly do not require grad: no trainable parameter outside the blocks except an
    untied `lm_head` (it reads the last block's output only), and no forward hook outside the blocks. Anything else
    may or may not feed the blocks: the first forward settles it (`observe.py`)."""
    inside = {id(m) for b in blocks for m in b.modules()}
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    head = embeddings(base, "output")
    emb = embeddings(model)
    emb_params = {id(p) for p in emb.parameters()} if emb is not None else set()
    head_params = {id(p) for p in head.parameters()} - emb_params if head is not None else set()
    if any(p.requires_grad and id(p) not in in_blocks and id(p) not in head_params for p in model.parameters()):
        return False
    head_modules = {id(m) for m in head.modules()} if head is not None else set()
    outside = (m for m in model.modules() if id(m) not in inside and id(m) not in head_modules)
    return not any(m._forward_hooks or m._forward_pre_hooks for m in outside)


def facts_from_trainer(args: Any, model: Any, stage: str = "init_end") -> Facts:
    """Facts from the arguments and the (unwrapped) model, as `on_init_end` sees them."""
    from transformers import PreTrainedModel

    facts = facts_from_args(args, stage=stage)
    base = ckpt.unwrap(model)
    blocks = ckpt.blocks(base)
    emb = embeddings(model)
    emb_trainable = bool(emb is not None and any(p.requires_grad for p in emb.parameters()))
    hooked = input_grad_hooks(model) > 0
    funcs = ckpt.functions(base)
    gc_on_model = bool(funcs)
    # a launcher's own checkpoint function (a wrapper around transformers' partial: LLaMA-Factory's) was put there on
    # purpose, with its use_reentrant, and may change the inputs inside the call (LLaMA-Factory's makes them require
    # grad): see ckpt.wrapped
    launcher_function = any(ckpt.wrapped(f) for _, f in funcs)
    # True: the embeddings require grad or carry the input hook (the Trainer's own, added in train(), counts too);
    # False: certainly not (nothing trainable or hooked upstream of the blocks, no wrapper around the checkpoint
    # call); None: settled at the first forward.
    inputs_grad: bool | None = True
    if not (emb_trainable or hooked or (facts.gc_enabled and _will_add_input_hook(base, facts))):
        inputs_grad = False if _nothing_upstream(model, base, blocks) and not launcher_function else None
    peft = is_peft_model(model)
    source = facts.use_reentrant_source
    if source == "unknown" and get_record(args) is None:
        source = _source_without_record(facts, peft)
    use_reentrant = facts.use_reentrant
    if launcher_function and source == "unset":
        # the arguments say nothing and the Trainer will not re-enable: the launcher's value is the one set
        use_reentrant, source = ckpt.model_use_reentrant(base), "unknown"
    return facts.replace(
        use_reentrant=use_reentrant,
        use_reentrant_source=source,
        launcher_checkpointing=launcher_function,
        gc_enabled=facts.gc_enabled or gc_on_model,
        model_gc_enabled=gc_on_model,
        model_use_reentrant=ckpt.model_use_reentrant(base) if gc_on_model else None,
        enable_refused=bool(facts.gc_enabled) and getattr(base, "supports_gradient_checkpointing", None) is False,
        is_peft=peft,
        alora=uses_alora(model) if peft else False,
        quantization=quantization_of(model),
        trainable_in_blocks=any(p.requires_grad for b in blocks for p in b.parameters()),
        frozen_params=any(not p.requires_grad for p in model.parameters()),
        inputs_require_grad=inputs_grad,
        use_cache=training_use_cache(args, base),
        model_is_pretrained=isinstance(model, PreTrainedModel),
        unsloth="unsloth" in sys.modules,
        legacy_checkpointing=uses_legacy_format(base),
        accelerator=accelerator_usable(),
        accelerator_built=accelerator_built(),
        dropout=has_dropout(base),
        shared_state_layers=shares_layer_state(base),
        router_logits_recorded=records_router_logits_in_blocks(base, blocks),
        moe_routers=moe_routers(base, blocks),
        fp8=fp8_training(model),
        shared_block_params=shares_block_params(blocks + layer_list_entries(base)),
        compiled=compiled(args, model),
        checkpoint_wrapped=checkpoint_wrapped(model),
    )


SELECTIVE_EXACT_VARIANTS = frozenset({"DoraLinearVariant", "DoraEmbeddingVariant"})
"""PEFT LoRA variants whose gradients under the planner's selective policy (`policies.selective_policy`) were measured
equal to those without checkpointing (peft 0.21.2, transformers 4.57.6 and 5.23.0: `tests/test_selective_peft.py`).
Plain LoRA (no variant) too; plain LoRA and DoRA under the lean policy (`policies.lean_policy`) as well. BD-LoRA
(`BdLoraLinearVariant`) was measured 0.59 off and aLoRA (`ALoraLinearVariant`, its adapter active from the invocation
token on) 1.61 off; the others were not measured."""


def moe_routers(base: Any, blocks: list[Any]) -> int:
    """How many checkpointable blocks hold an MoE router (a weight of shape (experts, hidden), `ckpt.router_of`)."""
    shapes = ckpt.router_shapes(base)
    return sum(ckpt.router_of(b, shapes) is not None for b in blocks) if shapes else 0


FP8_MODULES = frozenset({"Float8Linear", "Float8DynamicLinear", "TELinear", "Linear8bitFP"})
"""Module classes that run FP8 matmuls in training: torchao's `Float8Linear` (accelerate's `mixed_precision="fp8"`
with the torchao backend converts to it, as Axolotl's `fp8: true` does); Transformer Engine's `te.Linear` is read
by module path (`transformer_engine.`)."""


def fp8_training(model: Any) -> str | None:
    """What makes this model train its matmuls in FP8 (a module class or accelerate's mixed precision), None when
    nothing does."""
    for module in ckpt.unwrap(model).modules():
        cls = type(module)
        if cls.__name__ in FP8_MODULES or cls.__module__.startswith("transformer_engine."):
            return f"{cls.__module__}.{cls.__name__}"
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp8":
        return "ACCELERATE_MIXED_PRECISION=fp8"
    return None


def checkpoint_wrapped(model: Any) -> bool:
    """Some module of `model` is torch's `CheckpointWrapper` (`apply_activation_checkpointing`)."""
    return any(type(m).__name__ == "CheckpointWrapper" for m in ckpt.unwrap(model).modules())


def uses_alora(model: Any) -> bool:
    """Some LoRA layer of `model` runs an aLoRA adapter (PEFT's `ALoraLinearVariant`)."""
    return "ALoraLinearVariant" in selective_unsafe_adapters(model)


def selective_unsafe_adapters(model: Any) -> list[str]:
    """The PEFT adapter kinds of `model` the selective policy is not known to be exact for: LoRA variants outside
    `SELECTIVE_EXACT_VARIANTS`, and tuner layers other than LoRA's (IA3, LoHa, ...). Empty without PEFT."""
    found: set[str] = set()
    for module in ckpt.unwrap(model).modules():
        variants = getattr(module, "lora_variant", None)
        if isinstance(variants, dict):
            found.update(
                type(v).__name__ for v in variants.values() if type(v).__name__ not in SELECTIVE_EXACT_VARIANTS
            )
            continue
        kind = type(module)
        tuner = kind.__module__.startswith("peft.tuners.") and hasattr(module, "active_adapters")
        if tuner and not kind.__module__.startswith("peft.tuners.lora"):
            found.add(f"{kind.__module__.split('.')[2]}.{kind.__name__}")
    return sorted(found)


def layer_list_entries(model: Any) -> list[Any]:
    """The entries of the layer lists of modules that checkpoint (a stack with a `gradient_checkpointing` flag that
    calls `self._gradient_checkpointing_func(layer.__call__, ...)` itself, as Zamba2 does on transformers 4.57)."""
    import torch

    out: list[Any] = []
    for module in ckpt.unwrap(model).modules():
        if hasattr(module, "gradient_checkpointing") and not isinstance(module, torch.nn.ModuleList):
            for child in module.children():
                if isinstance(child, torch.nn.ModuleList):
                    out.extend(child)
    return out


def shares_block_params(blocks: list[Any]) -> bool:
    """A trainable parameter belongs to two outermost checkpointed blocks (Zamba2's shared transformer)."""
    blocks = list({id(b): b for b in blocks}.values())
    members = [{id(m) for m in b.modules()} for b in blocks]
    top = [
        b
        for b, mine in zip(blocks, members, strict=True)
        if not any(id(b) in other and other is not mine for other in members)
    ]
    ids = [i for block in top for i in {id(p) for p in block.parameters() if p.requires_grad}]
    return len(ids) != len(set(ids))


def accelerator_built() -> bool:
    """torch was built with an accelerator backend (what `pin_memory` needs), whether or not a device is there."""
    import torch

    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    if current is not None:  # without `check_available`: the backend torch was built with
        with contextlib.suppress(Exception):
            return current() is not None
    return bool(torch.backends.cuda.is_built() or torch.backends.mps.is_built())


def accelerator_usable() -> bool:
    """An accelerator device is usable now (a runtime check; a CUDA build on a machine without a GPU has none)."""
    import torch

    available = getattr(getattr(torch, "accelerator", None), "is_available", None)
    if available is not None:
        with contextlib.suppress(Exception):
            return bool(available())
    return bool(torch.cuda.is_available())


def offload_why_not(model: Any) -> str:
    """Why offloading activations to host memory frees no device memory for `model` ("" when it does: the model sits
    on a discrete accelerator): on the CPU, without a usable accelerator, or on an integrated GPU, whose memory is the
    host's (`is_integrated`; Apple silicon's unified memory too): offloading there costs copies for the same peak."""
    import torch

    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type in ("cpu", "meta"):
        return "the model is on the CPU: its activations are in host memory already"
    if not accelerator_usable():
        return "no accelerator is usable here"
    integrated = device.type == "mps"
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            integrated = bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))
    if integrated:
        return (
            f"the {device.type} device is integrated: its memory is the host's, so offloading copies activations for "
            "the same peak (unsloth-zoo #928 measured 2.15x slower with it on)"
        )
    return ""


def has_dropout(model: Any) -> bool:
    """Some random op is active in training: an `nn.Dropout` with p > 0, a config's `*dropout*` probability > 0
    (attention dropout is applied functionally, from the config), or a module's router jitter (`jitter_noise` > 0:
    Mixtral's sparse MoE block multiplies its router input by uniform noise in training; read on the module, not the
    config, which accepts the key for models that never use it)."""
    import torch

    base = ckpt.unwrap(model)
    for m in base.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any("jitter" in k and isinstance(v, float) and v > 0 for k, v in vars(m).items()):
            return True
    return any(
        "dropout" in k and isinstance(v, float) and v > 0 for c in model_configs(base) for k, v in vars(c).items()
    )


def records_router_logits_in_blocks(base: Any, blocks: list[Any]) -> bool:
    """The model's load-balancing loss reads router logits that a hook records inside its checkpointed blocks:
    `output_router_logits` on with a nonzero `router_aux_loss_coef`, and the class declares
    `_can_record_outputs["router_logits"]` (transformers' `OutputRecorder`) for a module class found in a block."""
    config = getattr(base, "config", None)
    if not getattr(config, "output_router_logits", False) or not getattr(config, "router_aux_loss_coef", 1.0):
        return False
    recorder = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", recorder)
    if not isinstance(target, type):
        return False
    return any(isinstance(m, target) for block in blocks for m in block.modules())


def shares_layer_state(model: Any) -> bool:
    """Cross-layer KV sharing (`num_kv_shared_layers`, Gemma 3n / Gemma 4): layers read another layer's tensors."""
    return any((getattr(c, "num_kv_shared_layers", 0) or 0) > 0 for c in model_configs(ckpt.unwrap(model)))


def uses_legacy_format(model: Any) -> bool:
    """The model overrides `_set_gradient_checkpointing` with the pre-4.35 `(module, value)` signature: transformers
    then calls it on every module and ignores the checkpointing kwargs (it says so in a warning)."""
    import inspect

    method = getattr(model, "_set_gradient_checkpointing", None)
    try:
        return method is not None and "value" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
