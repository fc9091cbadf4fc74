"""`Facts`: the plain values the decision engine works on (read off real arguments and models by `probe.py`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from .capabilities import Capabilities, for_versions

Source = Literal["user", "trainer", "plugin", "unset", "unknown"]
"""`trainer`: TRL writes args in its `__init__`; `unknown`: set by someone, treated as explicit."""

Stage = Literal["post_init", "init_end", "train"]


GENERATING_TRAINERS = frozenset({"grpo", "rloo", "online_dpo", "ppo", "xpo", "nash_md", "gkd", "distillation"})
"""TRL trainer kinds (`Facts.trainer_kind`, from the arguments' class) that generate with the policy while training."""
RL_TRAINERS = frozenset(
    {"dpo", "kto", "orpo", "cpo", "bco", "grpo", "rloo", "ppo", "online_dpo", "xpo", "nash_md", "reward", "prm"}
)
"""TRL's RL and preference trainer kinds."""


@dataclass(frozen=True)
class Facts:
    """What the engine needs to know about one training setup; `None`: not known at this stage (a rule needing it
    does not apply). The less obvious fields:

    - `versions`: evidence for the report; the rules gate on `caps` (`capabilities`, or the table for `versions`).
    - `use_reentrant`: as written in the args (may be a str from YAML); `kwargs_given`: a dict was given at all (`{}`
      counts: transformers 4.x and 5.x read it differently).
    - `legacy_kwargs` / `legacy_gc`: the deprecated `gradient_checkpointing*` values when they disagree with the
      `activation_*` fields (5.23+); `changed_field`: which name was written after `__post_init__`, when known.
    - `model_use_reentrant`: the value in the model's checkpoint function (`None` if off).
    - `router_logits_recorded`: the load-balancing loss reads router logits a hook records inside the blocks.
    - `moe_routers`: how many checkpointable blocks hold an MoE router (a weight of shape (experts, hidden)); the
      recompute must route as the forward did (`ckpt.faithful_blocks` keeps the logits under non-reentrant).
    - `fp8`: what trains the model's matmuls in FP8 (torchao `Float8Linear`, Transformer Engine, accelerate's
      `mixed_precision=fp8`), None when nothing does.
    - `enable_refused`: checkpointing asked for on a class with `supports_gradient_checkpointing = False`.
    - `launcher_checkpointing`: a launcher's own function wraps transformers' partial (LLaMA-Factory), on purpose.
    - `inputs_require_grad`: whether the hidden states entering the blocks will require grad; False only when
      certain, None when it depends on the data flow (the first training forward settles it, `observe.py`).
    - `gc_flag_source`: `trainer` when checkpointing is on by the config class's default (TRL).
    - `legacy_checkpointing`: the pre-4.35 `_set_gradient_checkpointing(module, value)` format: kwargs ignored.
    - `kwargs_keys`: the kwargs' keys other than `use_reentrant`; `kwargs_problem`: what is wrong with them as a
      container; `kwargs_unknown`: keys nothing reads, with the nearest known key (`settings`).
    - `selective`: a `context_fn` or a launcher's selective mode (non-reentrant only).
    - `accelerator`: one usable now (TRL's offloading streams); `accelerator_built`: torch built with a backend
      (what `offload=True`'s `pin_memory` needs: a CUDA build without a GPU trains).
    - `deepspeed_activation_checkpointing`: the DeepSpeed block sets one of its keys truthy (`deepspeed_config`).
    - `fsdp_wrapped`: False when accelerate fell back to DDP (e.g. on CPU); `fsdp` is then False too.
    - `shared_block_params`: a trainable parameter in two or more checkpointed blocks (Zamba2's shared block).
    - `checkpoint_wrapped`: a block wrapped by torch's `checkpoint_wrapper` (`_checkpoint_wrapped_module` keys).
    - `compiled`: why the forward runs under `torch.compile`, None when it does not.
    - `zero_overlap_comm`: as DeepSpeed resolves it (unset: True at stage 3); None without a readable config.
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
