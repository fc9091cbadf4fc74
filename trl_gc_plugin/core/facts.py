"""`Facts`: the plain values the decision engine works on.

Everything here is a frozen dataclass of builtins, so the engine can be exercised with hand-made facts and no
transformers import. The code that reads facts off real `TrainingArguments` and models lives in `probe.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from .capabilities import Capabilities, for_versions

Source = Literal["user", "trainer", "plugin", "unset", "unknown"]
"""Who set a value: the user, the trainer (TRL writes args in its `__init__`), this plugin, nobody (the library
default applies), or `unknown` (set, but by whom cannot be told: treated as explicit, never silently overridden)."""

Stage = Literal["post_init", "init_end", "train"]


GENERATING_TRAINERS = frozenset({"grpo", "rloo", "online_dpo", "ppo", "xpo", "nash_md", "gkd", "distillation"})
"""TRL trainer kinds (`Facts.trainer_kind`, from the arguments' class) that generate with the policy while training."""
RL_TRAINERS = frozenset(
    {"dpo", "kto", "orpo", "cpo", "bco", "grpo", "rloo", "ppo", "online_dpo", "xpo", "nash_md", "reward", "prm"}
)
"""TRL's RL and preference trainer kinds."""


@dataclass(frozen=True)
class Facts:
    """What the engine needs to know about one training setup.

    `None` means "not known at this stage" (e.g. model facts while only the arguments exist); rules that need a
    fact that is `None` do not apply.

    Args:
        stage: `post_init` (arguments only), `init_end` (arguments and model), `train` (checkpointing is live).
        versions: installed versions by distribution name (`transformers`, `trl`, `peft`, `torch`, `deepspeed`...):
            evidence for the report; the rules gate on `caps`.
        capabilities: what the checkpointing stack can do (`capabilities.py`), detected from the installed packages;
            `None` (hand-made facts, the checker) maps `versions` to capabilities through the verified table.
        gc_enabled: checkpointing requested in the args or already running on the model.
        use_reentrant: the `use_reentrant` value in the args, as written (may be a str from YAML); `None` if unset.
        use_reentrant_source: who wrote `use_reentrant` (see `Source`).
        kwargs_given: a kwargs dict was given at all (`{}` counts; transformers 4.x and 5.x read `{}` differently).
        has_activation_fields: the args have `activation_checkpointing*` fields (transformers 5.2x) beside the
            deprecated `gradient_checkpointing*` aliases.
        fields_disagree: the two kwargs fields (or the two bool fields) hold different values.
        legacy_kwargs / legacy_gc: `gradient_checkpointing_kwargs` / `gradient_checkpointing` when they disagree
            with the `activation_*` fields (which `use_reentrant` and `kwargs_given` describe).
        changed_field: which of the two names was written after `__post_init__`, when known (the post-init patch
            records a snapshot); `None` when unknown.
        model_gc_enabled: checkpointing already enabled on the model's layers.
        model_use_reentrant: the effective `use_reentrant` in the model's checkpoint function (`None` if off).
        router_logits_recorded: the loss adds a load-balancing term on router logits that a hook records inside the
            checkpointed blocks (`probe.records_router_logits_in_blocks`).
        enable_refused: the arguments ask for checkpointing and the model's class says
            `supports_gradient_checkpointing = False`, so the Trainer's `gradient_checkpointing_enable` will raise.
        launcher_checkpointing: the model checkpoints through a launcher's own function, a wrapper around
            transformers' partial (`ckpt.wrapped`: LLaMA-Factory's `custom_gradient_checkpointing_func`), put there on
            purpose before the Trainer; when the arguments leave `use_reentrant` unset, its value is the one set
            (`use_reentrant_source` `unknown`).
        is_peft: the model is a PEFT model.
        alora: some adapter is a PEFT aLoRA (activated LoRA: `alora_invocation_tokens`), None when not known.
        quantization: the quantization method (`bitsandbytes_4bit`, `gptq`, ...), `None` if not quantized.
        trainable_in_blocks: some trainable parameter lives inside a checkpointed block.
        frozen_params: some parameter is frozen.
        inputs_require_grad: whether the hidden states entering the checkpointed blocks will require grad: True
            (input embeddings trainable, or an input-require-grad hook registered or to be registered by the
            Trainer), False only when certain (no trainable parameter and no hook upstream of the blocks), None when
            it depends on the data flow (a learned position embedding, an embedding norm, a vision tower): then the
            first training forward settles it (`observe.py`).
        use_cache: `model.config.use_cache`.
        trainer_kind: short trainer name from the args class (`sft`, `dpo`, `grpo`, ... or `trainer`).
        generates: the trainer generates with the policy during training (GRPO, RLOO, online DPO...).
        world_size / zero_stage / fsdp / fsdp_activation_checkpointing / ddp_find_unused_parameters /
            ddp_static_graph: launch facts (from the launcher's environment, the args, the DeepSpeed config).
        model_is_pretrained: the model handed to the Trainer is a `PreTrainedModel` (a `PeftModel` is not).
        rl_trainer: an RL / preference trainer (DPO, GRPO, RLOO, KTO, ORPO, CPO, PPO, online DPO, ...).
        gc_flag_source: who set checkpointing on (`trainer` when it is the config class's default, as in TRL).
        unsloth: Unsloth is loaded (it replaces torch's checkpoint function and forces reentrant).
        legacy_checkpointing: the model uses the pre-4.35 `_set_gradient_checkpointing(module, value)` format, for
            which transformers ignores the checkpointing kwargs (remote code written before 4.35).
        kwargs_keys: the keys of the checkpointing kwargs other than `use_reentrant` (`every_n_layers`, `offload`,
            `preserve_rng_state`, `context_fn`, `determinism_check`, `debug`, ...).
        kwargs_problem: what is wrong with the checkpointing kwargs as a container (`str 'use_reentrant=True'`), None
            when they are a dict or unset (`settings.checkpoint_kwargs_problem`).
        kwargs_unknown: keys of the checkpointing kwargs that nothing reads (torch, transformers, the plugin), each
            with the nearest known key when one is close (`settings.unknown_checkpoint_keys`).
        every_n_layers / offload: transformers' layer selection (5.16+) and activation offloading (5.17+), as asked
            for in the kwargs (None / False when not asked for).
        preserve_rng_state: the kwargs' `preserve_rng_state` (None: torch's default, True).
        selective: per-op (selective) checkpointing is asked for (a `context_fn` in the kwargs, or a launcher's
            selective mode); only the non-reentrant implementation has it.
        accelerator: an accelerator device (CUDA, XPU, MPS, ...) is usable now (a runtime check: TRL's offloading
            streams need one); None unknown.
        accelerator_built: the installed torch was built with an accelerator backend (what `pin_memory` needs:
            transformers' `offload=True` pins its saved inputs; a CUDA build without a GPU pins nothing and trains);
            None unknown.
        trl_activation_offloading: a TRL config's `activation_offloading=True` (TRL wraps the model in its own
            offloading context in the trainer's `__init__`).
        dropout: some dropout probability of the model is > 0 (None: unknown).
        mixed_precision: the arguments train in bf16 or fp16 (`bf16` / `fp16`: accelerate's autocast, and FSDP2's
            `MixedPrecisionPolicy` under FSDP2); None unknown.
        shared_state_layers: some layers read tensors another layer computed outside their inputs (cross-layer KV
            sharing, `num_kv_shared_layers`); None unknown.
        deepspeed_activation_checkpointing: the DeepSpeed config's `activation_checkpointing` block sets one of
            DeepSpeed's keys to a truthy value (`_deepspeed`, the reading the check shares).
        fsdp_wrapped: FSDP was asked for and accelerate's state says whether it is applied (True) or not (False:
            accelerate fell back to DDP, e.g. on CPU); None when FSDP is not asked for or the state is not known yet.
            When False, `fsdp` is False too: the run is treated as the DDP run it is.
        fsdp_version: 1 or 2 when FSDP is asked for.
        shared_block_params: a trainable parameter belongs to two or more checkpointed blocks (a block shared across
            depth, Zamba2): two reentrant calls then send it gradients from two inner backwards.
        checkpoint_wrapped: some block is wrapped by torch's `checkpoint_wrapper` (`apply_activation_checkpointing`:
            Axolotl's activation offloading on a full fine-tune), which puts `_checkpoint_wrapped_module` in the module
            tree; None when not known.
        compiled: why the forward runs under `torch.compile` (`torch_compile=True`, `ACCELERATE_DYNAMO_BACKEND=...`,
            a model compiled in place or wrapped), None when it does not (`probe.compiled`; the check reads the
            config's `torch_compile`).
        cp_size: accelerate's context-parallel size (`parallelism_config.cp_size`, from the arguments or the
            environment `accelerate launch` exports: `_parallel`); 1 without context parallelism.
        zero_overlap_comm: DeepSpeed's `zero_optimization.overlap_comm` as DeepSpeed resolves it (ZeRO-1 reduces
            gradients during the backward only with it; unset or `auto`: True at stage 3, else False); None without a
            DeepSpeed config or when the config's stage is unreadable.
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
        """A copy with some fields changed (handy in tests and in the engine)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def version(self, package: str) -> str | None:
        return self.versions.get(package)
