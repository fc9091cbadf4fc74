"""`Facts`: the plain values the decision engine works on (read off real arguments and models by `probe.py`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from .capabilities import Capabilities, for_versions

Source = Literal["user", "trainer", "plugin", "unset", "unknown"]
"""Who set a value: the user, the trainer (TRL writes args in its `__init__`), this plugin, nobody (`unset`: the
library default applies), or `unknown` (set by someone who cannot be told: treated as explicit, never overridden)."""

Stage = Literal["post_init", "init_end", "train"]


GENERATING_TRAINERS = frozenset({"grpo", "rloo", "online_dpo", "ppo", "xpo", "nash_md", "gkd", "distillation"})
"""TRL trainer kinds (`Facts.trainer_kind`, from the arguments' class) that generate with the policy while training."""
RL_TRAINERS = frozenset(
    {"dpo", "kto", "orpo", "cpo", "bco", "grpo", "rloo", "ppo", "online_dpo", "xpo", "nash_md", "reward", "prm"}
)
"""TRL's RL and preference trainer kinds."""


@dataclass(frozen=True)
class Facts:
    """What the engine needs to know about one training setup: the engine's only input, builtins only, so rules run
    on hand-made facts without transformers. `None`: not known at this stage (a rule needing it does not apply).
    Field order is the JSON order of `to_dict`; the fields by concern:

    Stage and evidence
    - `stage`: `post_init` (arguments only), `init_end` (arguments and model), `train` (checkpointing is live).
    - `versions`: installed versions by distribution name: evidence for the report; the rules gate on `caps`.
    - `capabilities`: what the installed stack can do (`capabilities.py`); None: `versions` through the table.

    The checkpointing arguments
    - `gc_enabled`: checkpointing asked for in the arguments or already running on the model.
    - `gc_flag_source`: who turned it on (`trainer` when it is the config class's default, as in TRL).
    - `use_reentrant`: the arguments' value as written (may be a str from YAML); None when unset.
    - `use_reentrant_source`: who wrote `use_reentrant` (see `Source`).
    - `kwargs_given`: a kwargs dict was given at all (`{}` counts: transformers 4.x and 5.x read it differently).
    - `has_activation_fields`: the arguments have 5.2x's `activation_checkpointing*` fields beside the old names.
    - `fields_disagree`: the new and the deprecated `gradient_checkpointing*` fields hold different values.
    - `legacy_kwargs` / `legacy_gc`: the deprecated fields' values when they disagree with the `activation_*` ones.
    - `changed_field`: which name was written after `__post_init__` (the post-init snapshot), None when unknown.

    The checkpointing kwargs
    - `kwargs_keys`: their keys other than `use_reentrant` (`every_n_layers`, `offload`, `context_fn`, ...).
    - `kwargs_problem`: what is wrong with them as a container (`str 'use_reentrant=True'`); None for a dict or unset.
    - `kwargs_unknown`: keys nothing reads (torch, transformers, the plugin), each with the nearest known key.
    - `every_n_layers` / `offload`: transformers' layer selection (5.16+) and activation offloading (5.17+) asked for.
    - `preserve_rng_state`: the kwargs' value (None: torch's default, True).
    - `selective`: per-op checkpointing asked for (a `context_fn`, a launcher's selective mode): non-reentrant only.

    The model
    - `model_gc_enabled`: checkpointing already enabled on the model's layers.
    - `model_use_reentrant`: the effective value in the model's checkpoint function (None if off).
    - `enable_refused`: asked for on a class with `supports_gradient_checkpointing = False` (the Trainer raises).
    - `legacy_checkpointing`: the pre-4.35 `_set_gradient_checkpointing(module, value)` format: kwargs ignored.
    - `launcher_checkpointing`: a launcher's own wrapper of transformers' partial (LLaMA-Factory's), set on purpose.
    - `checkpoint_wrapped`: a block wrapped by torch's `checkpoint_wrapper` (`_checkpoint_wrapped_module` keys).
    - `model_is_pretrained`: the model handed to the Trainer is a `PreTrainedModel` (a `PeftModel` is not).
    - `is_peft`: a PEFT model; `alora`: some adapter is an activated LoRA (`alora_invocation_tokens`).
    - `quantization`: the quantization method (`bitsandbytes_4bit`, `gptq`, ...), None if not quantized.
    - `trainable_in_blocks`: some trainable parameter lives inside a checkpointed block.
    - `frozen_params`: some parameter is frozen.
    - `inputs_require_grad`: the hidden states entering the blocks require grad; False only when certain, None
      when the data flow decides (the first training forward settles it, `observe.py`).
    - `shared_block_params`: a trainable parameter in two or more checkpointed blocks (Zamba2's shared block).
    - `shared_state_layers`: layers read tensors another layer computed (cross-layer KV sharing).
    - `router_logits_recorded`: the load-balancing loss reads router logits a hook records inside the blocks.
    - `moe_routers`: checkpointable blocks holding an MoE router (a weight of shape (experts, hidden)).
    - `use_cache`: `model.config.use_cache`.
    - `dropout`: some dropout probability of the model is > 0.
    - `fp8`: what trains the matmuls in FP8 (torchao `Float8Linear`, Transformer Engine, accelerate's `fp8`).
    - `compiled`: why the forward runs under `torch.compile`, None when it does not.

    The trainer
    - `trainer_kind`: short name from the arguments' class (`sft`, `dpo`, `grpo`, ... or `trainer`).
    - `generates`: the trainer generates with the policy while training (`GENERATING_TRAINERS`).
    - `rl_trainer`: an RL or preference trainer (`RL_TRAINERS`).
    - `trl_activation_offloading`: TRL's `activation_offloading=True` (TRL wraps the model in its `__init__`).
    - `unsloth`: Unsloth is loaded (it replaces torch's checkpoint function and forces reentrant).
    - `mixed_precision`: bf16 or fp16 training (accelerate's autocast, and FSDP2's `MixedPrecisionPolicy`).

    The launch
    - `world_size`: processes in the launch.
    - `zero_stage`: the DeepSpeed ZeRO stage, None without DeepSpeed.
    - `zero_overlap_comm`: `overlap_comm` as DeepSpeed resolves it (unset: True at stage 3); None without a config.
    - `deepspeed_activation_checkpointing`: the DeepSpeed block sets one of its keys truthy (`deepspeed_config`).
    - `fsdp`: FSDP is asked for (and applied); `fsdp_version`: 1 or 2 then.
    - `fsdp_wrapped`: False when accelerate fell back to DDP (e.g. on CPU); `fsdp` is then False too.
    - `fsdp_activation_checkpointing`: FSDP's own `activation_checkpointing` option is on.
    - `ddp_find_unused_parameters` / `ddp_static_graph`: the arguments' DDP options (None: unset).
    - `cp_size`: accelerate's context-parallel size (`parallelism_config.cp_size`); 1 without it.
    - `accelerator`: an accelerator is usable now (TRL's offloading streams need one).
    - `accelerator_built`: torch was built with a backend (`offload=True`'s `pin_memory`; a CUDA build without a GPU
      trains).
    """

    stage: Stage = "init_end"
    versions: dict[str, str | None] = field(default_factory=dict)
    gc_enabled: bool = False
    use_reentrant: Any = None
    use_reentrant_source: Source = "unset"
    kwargs_given: bool = False
    has_activation_fields: bool = False
    fields_disagree: bool = False
    legacy_kwargs: dict[str, Any] | None = None
    legacy_gc: bool | None = None
    changed_field: Literal["legacy", "new"] | None = None
    model_gc_enabled: bool | None = None
    model_use_reentrant: bool | None = None
    enable_refused: bool | None = None
    router_logits_recorded: bool | None = None
    moe_routers: int | None = None
    fp8: str | None = None
    launcher_checkpointing: bool = False
    is_peft: bool | None = None
    alora: bool | None = None
    quantization: str | None = None
    trainable_in_blocks: bool | None = None
    frozen_params: bool | None = None
    inputs_require_grad: bool | None = None
    use_cache: bool | None = None
    trainer_kind: str = "trainer"
    generates: bool = False
    world_size: int = 1
    zero_stage: int | None = None
    fsdp: bool = False
    fsdp_activation_checkpointing: bool = False
    ddp_find_unused_parameters: bool | None = None
    ddp_static_graph: bool | None = None
    model_is_pretrained: bool | None = None
    rl_trainer: bool = False
    gc_flag_source: Source = "unset"
    unsloth: bool = False
    legacy_checkpointing: bool = False
    kwargs_keys: tuple[str, ...] = ()
    kwargs_problem: str | None = None
    kwargs_unknown: tuple[str, ...] = ()
    every_n_layers: int | None = None
    offload: bool = False
    preserve_rng_state: bool | None = None
    selective: bool = False
    accelerator: bool | None = None
    accelerator_built: bool | None = None
    trl_activation_offloading: bool = False
    dropout: bool | None = None
    mixed_precision: bool | None = None
    shared_state_layers: bool | None = None
    deepspeed_activation_checkpointing: bool = False
    fsdp_wrapped: bool | None = None
    fsdp_version: int | None = None
    shared_block_params: bool | None = None
    zero_overlap_comm: bool | None = None
    compiled: str | None = None
    checkpoint_wrapped: bool | None = None
    cp_size: int = 1
    capabilities: Capabilities | None = None

    @property
    def caps(self) -> Capabilities:
        """The capabilities the rules gate on: detected ones when given, else those of `versions` (the table)."""
        return self.capabilities if self.capabilities is not None else for_versions(self.versions)

    @property
    def ddp(self) -> bool:
        """Plain torch DDP: several processes, no DeepSpeed, no FSDP."""
        return self.world_size > 1 and self.zero_stage is None and not self.fsdp

    @property
    def ddp_find_unused(self) -> bool:
        """Whether DDP will look for unused parameters, as transformers decides it: the argument when set; else
        on for models that are not a `PreTrainedModel` (a `PeftModel`), off for those with checkpointing on."""
        if not self.ddp or self.ddp_static_graph:
            return False
        if self.ddp_find_unused_parameters is not None:
            return bool(self.ddp_find_unused_parameters)
        return self.model_is_pretrained is False

    @property
    def reduces_per_parameter(self) -> bool:
        """The gradient wrapper reduces each parameter's gradient once per backward, from a hook: DeepSpeed ZeRO-2
        and ZeRO-3, ZeRO-1 with `overlap_comm`, torch DDP without a static graph."""
        return bool(
            self.zero_stage in (2, 3)
            or (self.zero_stage == 1 and self.zero_overlap_comm)
            or (self.ddp and not self.ddp_static_graph)
        )

    def replace(self, **changes: Any) -> Facts:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
