"""The rule table: every rule the plugin applies, as data (`docs/rules.md` and `python -m trl_gc_plugin rules` are
generated from it; `remove_when` says when a rule is dead weight, as TRL's `trl/_compat.py` does for its patches).

Kinds: `require` (unset -> filled; an explicit other value -> `error` in strict, `override` in fix, `warn` in warn
mode; a value the trainer or the plugin wrote is overridden), `prefer` (unset -> filled; an explicit other value kept
with a warning), `repair` (an upstream inconsistency, fixed), `check` (a warning), `verify` (a check of the running
training, by the callback), `state` (the engine's answer about the whole setup), `plan` (how much to checkpoint within
a memory budget, `planner.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .decisions import Action, Decision, Level, level_of
from .facts import Facts
from .kwargs import LAYER_KWARGS

RuleKind = Literal["require", "prefer", "repair", "check", "verify", "plan", "state"]

USE_REENTRANT = "use_reentrant"
"""The setting most rules are about: `use_reentrant` in the checkpointing kwargs of the args (both field names)."""

TORCH_CHECKPOINT_DOCS = "https://docs.pytorch.org/docs/stable/checkpoint.html"

NON_REENTRANT_ONLY = frozenset({"context_fn", "debug", "determinism_check", "respect_saved_tensors_hooks"})
"""Checkpointing kwargs only torch's non-reentrant implementation has (`respect_saved_tensors_hooks`: torch 2.14+)."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One rule of the table.

    `id` is a stable public identifier: logs, `gc_decisions.json`, error messages and `docs/rules.md` name the rule
    by it and users search for it, so renaming one is a breaking change. `when` is a predicate on the facts of the
    current stage (`condition` says it in words; runtime rules have none: the running training's checks apply them);
    `needs` maps `Capabilities` fields to the value the rule needs (unknown fails the gate); `versions` are
    PEP 440 specifiers of the releases where the evidence was read (documentation, not a gate); `stand_back`: when it
    applies the plugin decides nothing else (another library owns checkpointing); `fix_overrides`: a `prefer` whose
    explicit other value fix mode overrides (strict and warn keep it and say so: the first step's evidence decides a
    refusal); `detail`: the fact-specific first sentence of a reason; `level`: how its repairs and checks are logged
    (refusals are errors, overrides of a user's value warnings)."""

    id: str
    title: str
    kind: RuleKind
    setting: str
    value: Any = None
    condition: str
    message: str
    evidence: tuple[str, ...]
    versions: dict[str, str] = field(default_factory=dict)
    needs: dict[str, bool] = field(default_factory=dict)
    remove_when: str = ""
    stages: tuple[str, ...] = ()
    stand_back: bool = False
    fix_overrides: bool = False
    level: Level = "warning"
    when: Callable[[Facts], bool] = field(default=lambda f: False, compare=False)
    detail: Callable[[Facts], str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.stages:
            runtime = self.kind in ("verify", "plan")
            object.__setattr__(self, "stages", ("runtime",) if runtime else ("post_init", "init_end", "train"))

    def decision(
        self,
        action: Action,
        before: Any,
        after: Any,
        source: str,
        reason: str,
        stage: str,
        setting: str | None = None,
        level: Level | None = None,
    ) -> Decision:
        """A decision of this rule (its id, setting and evidence); applied when the action changes something; logged
        at `level`, by default the one `level_of` gives for the action and the rule."""
        return Decision(
            rule_id=self.id,
            action=action,
            setting=setting or self.setting,
            before=before,
            after=after,
            source=source,
            reason=reason,
            evidence=self.evidence,
            applied=action in ("default", "override", "repair"),
            stage=stage,
            level=level or level_of(action, self.level),
        )

    def to_dict(self) -> dict[str, Any]:
        """The rule as plain data (the predicate is represented by its `condition` text)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("when", "detail")}
        return {**data, "evidence": list(self.evidence), "stages": list(self.stages)}


def unread_layer_kwargs(f: Facts) -> tuple[str, ...]:
    """The layer kwargs asked for that the transformers of `f` cannot read (they would reach torch)."""
    reads = f.caps.layer_kwargs()
    unknown = f.caps.every_n_layers is None  # transformers absent or unreadable: nothing to say
    return () if unknown else tuple(k for k in LAYER_KWARGS if k in f.kwargs_keys and k not in reads)


def _non_reentrant_only(f: Facts) -> set[str]:
    """The keys of the kwargs that only non-reentrant checkpointing takes, among those the installed torch reads (a key
    it does not read, `respect_saved_tensors_hooks` before 2.14, is rule `checkpointing-kwargs-unknown`'s)."""
    unknown = {key.split(" ")[0] for key in f.kwargs_unknown}
    return (set(f.kwargs_keys) & NON_REENTRANT_ONLY) - unknown


def _frozen_inputs(f: Facts) -> bool:
    # aLoRA's inputs are made to require grad (rule `alora-needs-input-grads`): reentrant then trains
    return bool(f.gc_enabled and f.trainable_in_blocks and f.inputs_require_grad is False and not f.alora)


RULES: tuple[Rule, ...] = (
    Rule(
        id="checkpointing-off",
        title="checkpointing is off: nothing to decide",
        kind="state",
        setting="activation_checkpointing",
        value=False,
        when=lambda f: not f.gc_enabled and not f.fsdp_activation_checkpointing,
        condition=(
            "neither the Trainer's checkpointing (`gradient_checkpointing` / `activation_checkpointing`) nor "
            "FSDP's own is on"
        ),
        message=(
            "Checkpointing is off: nothing to decide. Only the `check` rules are said (e.g. checkpointing that "
            "runs on the model although the arguments say off)."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/trainer.py (checkpointing is "
            "enabled on the model only when args.activation_checkpointing is true)",
        ),
        remove_when="never: it is the engine's answer for a run without checkpointing",
        level="info",
    ),
    Rule(
        id="conflict",
        title="rules demand opposite use_reentrant values",
        kind="state",
        setting=USE_REENTRANT,
        condition="two `require` rules that apply demand opposite `use_reentrant` values",
        message="No value of use_reentrant trains this setup correctly: change one of the settings the rules name.",
        evidence=(
            TORCH_CHECKPOINT_DOCS,
            "trl_gc_plugin.core.engine.decide: the require rules are collected before any value is chosen",
        ),
        remove_when="never: it is the engine's answer when its own rules disagree",
    ),
    Rule(
        id="invalid-use-reentrant",
        title="use_reentrant must be a bool",
        kind="repair",
        setting=USE_REENTRANT,
        when=lambda f: f.use_reentrant is not None and not isinstance(f.use_reentrant, bool),
        condition="`use_reentrant` holds a non-bool (e.g. the string 'false' from YAML or the command line)",
        message=(
            "torch reads any non-empty string as True, so `use_reentrant: 'false'` silently means reentrant. "
            "Recognised strings ('true'/'false'/'1'/'0'/'yes'/'no') are converted; anything else is refused. "
            "Write a YAML/JSON boolean: `use_reentrant: false`."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/training_args.py "
            "(_convert_str_dict: only JSON-string kwargs are converted)",
            TORCH_CHECKPOINT_DOCS,
        ),
        remove_when="transformers validates the type of `use_reentrant` itself",
    ),
    Rule(
        id="checkpointing-kwargs-not-a-dict",
        title="the checkpointing kwargs must be a dict",
        kind="require",
        setting="checkpointing_kwargs.container",
        value="dict",
        when=lambda f: bool(f.gc_enabled and f.kwargs_problem),
        condition=(
            "`gradient_checkpointing_kwargs` / `activation_checkpointing_kwargs` hold something other than a dict "
            "(a string that is not JSON, a list)"
        ),
        message=(
            "Without the plugin the Trainer stops when it enables checkpointing (4.x: 'functools.partial() argument "
            "after ** must be a mapping'; 5.x: 'dictionary update sequence element #0 ...'); nothing the plugin could "
            "do with it would be what you wrote. Write a dict, e.g. gradient_checkpointing_kwargs={'use_reentrant': "
            "False} (a JSON string of one is parsed by transformers). In fix mode the plugin replaces it with a dict "
            "holding its own use_reentrant."
        ),
        evidence=(
            "reproduced: transformers 4.57.6, TRL 1.16, gradient_checkpointing_kwargs='use_reentrant=True' or "
            "['use_reentrant'] -> TypeError: functools.partial() argument after ** must be a mapping; transformers "
            "5.23.0 -> ValueError: dictionary update sequence element #0 has length 1; 2 is required",
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/training_args.py "
            "(_convert_str_dict: only JSON strings are converted to dicts)",
        ),
        remove_when="transformers validates the type of the checkpointing kwargs in __post_init__",
        detail=lambda f: f"The checkpointing kwargs are a {f.kwargs_problem}, not a dict.",
    ),
    Rule(
        id="checkpointing-kwargs-unknown-reentrant",
        title="no unknown checkpointing kwargs with reentrant checkpointing",
        kind="require",
        setting="checkpointing_kwargs.unknown",
        value=[],
        when=lambda f: bool(f.gc_enabled and f.kwargs_unknown and f.use_reentrant is True),
        condition=(
            "`use_reentrant=True` and a key of the checkpointing kwargs that neither torch.utils.checkpoint, "
            "transformers nor the plugin reads"
        ),
        message=(
            "torch's reentrant checkpoint raises 'ValueError: Unexpected keyword arguments' at the first training "
            "forward. Correct the key (or remove it); in fix mode the plugin removes it from the kwargs."
        ),
        evidence=(
            "reproduced: `TRL_GC_PLUGIN=1 trl sft` (TRL 1.16.0, transformers 5.23.0, torch 2.13.0) with "
            "gradient_checkpointing_kwargs {use_reentrant: true, preserve_rng: false} -> ValueError: Unexpected "
            "keyword arguments: preserve_rng, in the first forward",
            TORCH_CHECKPOINT_DOCS,
        ),
        remove_when="torch's reentrant checkpoint ignores unknown keywords",
        detail=lambda f: "Unknown key(s) in the checkpointing kwargs: " + ", ".join(f.kwargs_unknown) + ".",
    ),
    Rule(
        id="checkpointing-kwargs-unknown",
        title="checkpointing kwargs nothing reads",
        kind="check",
        setting="checkpointing_kwargs.unknown",
        when=lambda f: bool(f.gc_enabled and f.kwargs_unknown and f.use_reentrant is not True),
        condition=(
            "`use_reentrant` not True and a key of the checkpointing kwargs is read by neither the installed "
            "torch.utils.checkpoint (its signature), transformers (`every_n_layers`, `offload`) nor the plugin "
            "(`selective`)"
        ),
        message=(
            "With use_reentrant=False torch passes unknown keys on to the checkpointed layer, whose **kwargs swallow "
            "them: the setting silently does nothing. With use_reentrant=True torch raises 'Unexpected keyword "
            "arguments' in the first forward. Correct or remove them."
        ),
        evidence=(
            "reproduced: transformers 4.57.6, {'use_reentrant': False, 'use_reentrent': True} trains with the typo "
            "ignored; torch 2.13 reentrant checkpoint with an unknown keyword -> ValueError: Unexpected keyword "
            "arguments",
            TORCH_CHECKPOINT_DOCS,
        ),
        remove_when="torch or transformers rejects unknown checkpointing keywords",
        detail=lambda f: "Unknown key(s) in the checkpointing kwargs: " + ", ".join(f.kwargs_unknown) + ".",
    ),
    Rule(
        id="field-disagreement",
        title="activation_* and gradient_* fields must agree",
        kind="repair",
        setting="activation_checkpointing_kwargs",
        when=lambda f: f.has_activation_fields and f.fields_disagree,
        condition=(
            "the args have both `activation_checkpointing(_kwargs)` and the deprecated "
            "`gradient_checkpointing(_kwargs)` and they hold different values (something assigned one name after "
            "`__post_init__`)"
        ),
        message=(
            "Trainer reads only `activation_checkpointing*`; a later write to the deprecated `gradient_checkpointing*` "
            "(TRL 1.16 does this for PEFT + DeepSpeed ZeRO-3) is silently ignored. The plugin copies the value that "
            "was written last into both names and makes them one object again."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/training_args.py "
            "(__post_init__ aliases the old names once)",
            "https://github.com/huggingface/trl/blob/v1.16.0/trl/trainer/sft_trainer.py (PEFT + ZeRO-3: assigns a "
            "new dict to gradient_checkpointing_kwargs)",
            "https://github.com/huggingface/trl/issues/2514",
        ),
        versions={"transformers": ">=5.23"},
        needs={"activation_fields": True},
        remove_when=(
            "transformers drops the deprecated `gradient_checkpointing*` aliases (v6), or TRL writes the new names"
        ),
        level="info",
    ),
    Rule(
        id="unsloth-owns-checkpointing",
        title="Unsloth replaces checkpointing",
        kind="check",
        setting="use_reentrant",
        when=lambda f: f.gc_enabled and f.unsloth,
        condition="Unsloth is loaded (`unsloth` imported): it swaps torch's checkpoint for `unsloth_checkpoint`",
        message=(
            "Unsloth's own checkpointing ignores `use_reentrant` (it always recomputes its own way), so the plugin "
            "stands back and changes nothing; the setting has no effect here."
        ),
        evidence=("https://github.com/unslothai/unsloth (unsloth_checkpoint / use_gradient_checkpointing='unsloth')",),
        remove_when="never: Unsloth owns checkpointing when loaded",
        stand_back=True,
        level="info",
    ),
    Rule(
        id="legacy-checkpointing-format",
        title="pre-4.35 checkpointing format: the kwargs never reach the model",
        kind="check",
        setting="use_reentrant",
        when=lambda f: f.gc_enabled and f.legacy_checkpointing,
        condition=(
            "the model defines `_set_gradient_checkpointing(module, value)` (remote code written before transformers "
            "4.35)"
        ),
        message=(
            "transformers calls the model's own `_set_gradient_checkpointing` and ignores the checkpointing kwargs, so "
            "`use_reentrant` (yours or the plugin's) has no effect: the model's code calls torch.utils.checkpoint "
            "itself, usually without `use_reentrant`, which torch runs reentrant. The plugin decides nothing here; its "
            "runtime checks still run, but a block checkpointed outside transformers' convention is not seen. Update "
            "the model code to the current format (drop its `_set_gradient_checkpointing`) to control the mode."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/modeling_utils.py "
            "(_is_using_old_format: 'We will also silently ignore `activation_checkpointing_kwargs`')",
            "reproduced: tests/custom_models.py LegacyModel (the kwargs never reach it; torch runs it reentrant)",
        ),
        remove_when="transformers drops the old `_set_gradient_checkpointing(module, value)` format",
        stand_back=True,
    ),
    Rule(
        id="fsdp-activation-checkpointing",
        title="FSDP's checkpointing or the Trainer's, not both",
        kind="require",
        setting="activation_checkpointing",
        value=False,
        when=lambda f: f.fsdp and f.fsdp_activation_checkpointing and f.gc_enabled,
        condition="FSDP with `fsdp_config['activation_checkpointing']=True` and the Trainer's checkpointing on",
        message=(
            "transformers refuses both at once in Trainer.__init__. Keep FSDP's own activation checkpointing (it "
            "wraps the blocks itself and is non-reentrant, so frozen and PEFT parameters train) and set "
            "gradient_checkpointing=False (activation_checkpointing=False on transformers >= 5.23)."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/trainer.py (ValueError: both "
            "activation checkpointing options)",
            "https://huggingface.co/docs/accelerate/usage_guides/fsdp",
        ),
        remove_when="transformers merges the two options",
    ),
    Rule(
        id="router-logits-need-non-reentrant",
        title="MoE load-balancing loss: reentrant gives the router no gradient from it",
        kind="require",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: bool(f.gc_enabled) and f.router_logits_recorded is True,
        condition=(
            "checkpointing on, `output_router_logits=True` with a nonzero `router_aux_loss_coef`, and the model "
            "records its router logits with a hook on a module inside the checkpointed blocks "
            "(`_can_record_outputs['router_logits']`)"
        ),
        message=(
            "Reentrant checkpointing runs the block's forward without autograd, so the router logits the hook "
            "records there carry no graph: the load-balancing loss adds nothing to the routers' gradients, silently "
            "(relative error 1.0 against no checkpointing). Non-reentrant is exact: use_reentrant=False (or "
            "output_router_logits=False if the auxiliary loss is not wanted)."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/utils/output_capturing.py "
            "(OutputRecorder: forward hooks collect the outputs)",
            "reproduced: transformers 5.23.0 (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE) and 4.57.6 (Mixtral, Qwen3-MoE), "
            "torch 2.13.0: router gradients with reentrant checkpointing differ from no checkpointing by a relative "
            "1.0, non-reentrant by 0.0; on 4.57.6 Qwen2-MoE and OLMoE return router logits as layer outputs (no "
            "recorder) and reentrant is exact there",
        ),
        versions={"transformers": ">=4.57.6"},
        remove_when=(
            "transformers records router logits outside the checkpointed call, or reentrant checkpointing "
            "returns what a hook records inside it"
        ),
    ),
    Rule(
        id="moe-routing-recomputed",
        title="MoE routing recomputed in the backward: non-reentrant keeps the forward's router logits",
        kind="prefer",
        setting=USE_REENTRANT,
        value=False,
        fix_overrides=True,
        when=lambda f: bool(f.gc_enabled and f.moe_routers),
        stages=("init_end", "train"),
        condition=(
            "checkpointing on and a checkpointed block holds an MoE router (a weight of shape (experts, "
            "hidden)); `use_reentrant=True` set explicitly"
        ),
        message=(
            "Full checkpointing runs the router again in the backward: where its logits differ from the forward's "
            "(nondeterministic GEMMs, another kernel, bf16 near a top-k tie), tokens go to other experts, and the "
            "backward either fails (`CheckpointError: A different number of tensors was saved`, verl #7016) or, "
            "silently, trains on other gradients (13% off, reproduced). Under non-reentrant the plugin keeps each "
            "router's logits from the forward (tokens x experts values per block), so the recompute routes as the "
            "forward did: use_reentrant=False. Under reentrant (no context_fn there) the first step's parity probe "
            "decides: a difference far beyond numerical noise is refused in strict mode."
        ),
        evidence=(
            "https://github.com/verl-project/verl/issues/7016 (Qwen3-30B-A3B + FSDP2 + checkpointing: CheckpointError "
            "1730 vs 178 tensors)",
            "https://github.com/verl-project/verl/issues/3258",
            "https://github.com/ByteDance-Seed/VeOmni/issues/979 (intermittent, MoE + checkpointing)",
            "https://github.com/pytorch/torchtitan/pull/3146 (torchtitan keeps aten.topk's output for this reason)",
            "reproduced (tests/test_recompute.py): tiny Mixtral and Qwen3-MoE, the router's input perturbed in the "
            "recompute only: transformers 4.57.6 non-reentrant CheckpointError (a different number of tensors), 5.23.0 "
            "gradients off; reentrant off on both; with the router's logits kept, equal to no checkpointing",
        ),
        versions={"transformers": ">=4.53.2", "torch": ">=2.4"},
        remove_when=(
            "transformers keeps the routing decision across the recompute itself (or checkpoints the "
            "router outside the block)"
        ),
    ),
    Rule(
        id="fp8-checkpointing",
        title="FP8 training with checkpointing: the memory and the FP8 speed-up are not what they seem",
        kind="check",
        setting="fp8",
        level="warning",
        when=lambda f: bool(f.gc_enabled and f.fp8),
        detail=lambda f: f"The model trains in FP8 ({f.fp8}) with checkpointing on.",
        condition=(
            "checkpointing on and the model's matmuls run in FP8 (torchao `Float8Linear`, Transformer Engine, "
            "accelerate's `mixed_precision: fp8`, Axolotl's `fp8: true`)"
        ),
        message=(
            "Checkpointing recomputes the FP8 casts and scales of every checkpointed matmul in the backward, and what "
            "the blocks keep is not priced as FP8: reported as less memory saved than expected and the FP8 speed-up "
            "lost (torchao float8 with activation checkpointing). Measure the step time and peak memory with and "
            "without checkpointing before keeping both; the plugin's memory planner does not plan for FP8 activations "
            "(it would price them as 16-bit)."
        ),
        evidence=(
            "https://github.com/pytorch/ao/issues/2445 (float8 training + activation checkpointing: memory and speed)",
            "https://github.com/pytorch/ao/pull/3349",
            "https://github.com/axolotl-ai-cloud/axolotl/pull/2926 (fp8: true with gradient checkpointing)",
        ),
        versions={"torchao": ">=0.10"},
        remove_when="torchao's float8 training saves and recomputes its casts under checkpointing as it does without",
    ),
    Rule(
        id="model-cannot-checkpoint",
        title="the model's class refuses checkpointing",
        kind="require",
        setting="activation_checkpointing",
        value=False,
        when=lambda f: f.enable_refused is True,
        condition=(
            "the arguments ask for checkpointing and the model's class has `supports_gradient_checkpointing = False` "
            "(read on the unwrapped model)"
        ),
        message=(
            "transformers raises `ValueError: ... does not support gradient checkpointing` ('activation checkpointing' "
            "on 5.23) when `Trainer.train()` enables it, before the first step. Set gradient_checkpointing=False "
            "(activation_checkpointing=False on transformers >= 5.23), or use a model class that supports it (a class "
            "that says False while its blocks checkpoint needs the model's own fix: NemotronH until transformers PR "
            "45625)."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/modeling_utils.py "
            "(gradient_checkpointing_enable: `if not self.supports_gradient_checkpointing: raise ValueError`)",
            "https://github.com/verl-project/verl/issues/7146",
            "https://github.com/huggingface/transformers/pull/45625 (NemotronH's flag, its blocks already checkpoint)",
            "reproduced: transformers 5.23.0 and 4.57.6, a tiny Llama class with supports_gradient_checkpointing = "
            "False: Trainer.train() raises the ValueError before any update",
        ),
        remove_when="never: it restates transformers' own refusal before the run starts, with the setting to change",
        stages=("init_end", "train"),
    ),
    Rule(
        id="activation-offloading-needs-accelerator",
        title="TRL's activation offloading without an accelerator",
        kind="require",
        setting="activation_offloading",
        value=False,
        when=lambda f: f.trl_activation_offloading and f.accelerator is False,
        condition=(
            "a TRL config with `activation_offloading=True`, checkpointing on, and no accelerator on this machine"
        ),
        message=(
            "TRL's offloading context reads `torch.accelerator.current_accelerator().type` when the trainer is built, "
            "so SFTTrainer stops with `AttributeError: 'NoneType' object has no attribute 'type'` before any step (and "
            "there is nothing to offload to). Set activation_offloading=False on this machine. Only the install() / "
            "TRL_GC_PLUGIN=1 route can say it first: the trainer fails before any callback runs."
        ),
        evidence=(
            "https://github.com/huggingface/trl/blob/v1.16.0/trl/models/activation_offloading.py "
            "(OffloadActivations.__init__)",
            "reproduced: TRL 1.16.0, torch 2.13.0+cpu, SFTConfig(activation_offloading=True): AttributeError in "
            "SFTTrainer.__init__, with and without gradient checkpointing",
        ),
        versions={"trl": ">=1.16.0"},
        remove_when="TRL checks for an accelerator itself before it builds the offloading context",
    ),
    Rule(
        id="trl-activation-offloading-stream-races",
        title="TRL's activation offloading without its stream fixes",
        kind="check",
        setting="activation_offloading",
        when=lambda f: f.trl_activation_offloading and f.accelerator is not False,
        detail=lambda f: (
            f"transformers {f.versions.get('transformers') or ''} has its own `offload` (gradient_checkpointing_kwargs="
            "{'offload': True}: each checkpointed layer's inputs saved on the CPU at layer boundaries, no side "
            "stream): use it instead, or"
            if f.caps.offload
            else "Upgrade TRL to 1.14 or later, or"
        ),
        condition=(
            "a TRL config with `activation_offloading=True` on an accelerator, and the installed TRL's "
            "`OffloadActivations` lacks the stream fixes (read in its source: the compute stream cached at "
            "construction, offset views cloned after the transfer stream's wait) or keeps the storage-address dedupe "
            "entries of released tensors"
        ),
        message=(
            "set activation_offloading=False. This TRL's offloading races its copy stream against the compute "
            "stream: reported as a device-side assert at the first backward (20 of 20 runs) or silently corrupted "
            "saved tensors such as the loss's shifted labels; TRL 1.14 fixed both races."
        ),
        evidence=(
            "https://github.com/huggingface/trl/pull/7195 (two stream races in OffloadActivations; first in TRL "
            "1.14.0)",
            "https://github.com/axolotl-ai-cloud/axolotl/pull/3833 (shift_labels cloned on the transfer stream: "
            "device-side assert in nll_loss backward, 20/20 runs unpatched)",
            "https://github.com/huggingface/trl/pull/5700 (streams synced and stashes cleared in __exit__: a 5 GB "
            "leak)",
            "https://github.com/huggingface/trl/pull/6241 (the storage-address dedupe kept the entries of released "
            "tensors: the allocator reuses a freed address and the new tensor is not offloaded)",
            "read: TRL wheels 0.20.0, 0.26.2, 1.10.0-1.13.0 lack the stream fixes; 1.14.0, 1.15.0, 1.16.0 have them "
            "(capabilities.detect_trl_offload); the dedupe release of PR 6241: 0.26.2 lacks it, 1.10.0-1.16.0 have it",
        ),
        versions={"trl": "<1.14.0"},
        needs={"trl_offload_stream_fixes": False},
        remove_when="the plugin's floor TRL is 1.14 or later",
    ),
    Rule(
        id="zero3-frozen-needs-reentrant",
        title="ZeRO-3 + frozen params on old DeepSpeed: reentrant",
        kind="require",
        setting=USE_REENTRANT,
        value=True,
        when=lambda f: bool(f.gc_enabled and f.zero_stage == 3 and f.frozen_params),
        condition="DeepSpeed ZeRO-3, frozen parameters (PEFT, QLoRA, partial freezing), checkpointing on",
        message=(
            "DeepSpeed < 0.19.3 re-partitions frozen parameters before the non-reentrant recompute: "
            "`CheckpointError: Recomputed values for the following tensors have different metadata` in the first "
            "backward. Upgrade to deepspeed>=0.19.3 (DeepSpeed PR 8148) to use non-reentrant; otherwise use "
            "reentrant with input gradients enabled (TRL calls `enable_input_require_grads()` for PEFT)."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/issues/47254",
            "https://github.com/huggingface/trl/issues/2514",
            "https://github.com/deepspeedai/DeepSpeed/pull/8148 (in_checkpoint_recompute guard; first released in "
            "0.19.3)",
            "https://github.com/axolotl-ai-cloud/axolotl (seed 001, rule 3: QLoRA + ZeRO-3 + use_reentrant False)",
        ),
        versions={"deepspeed": "<0.19.3"},
        needs={"deepspeed_recompute_fix": False},
        remove_when="the minimum supported DeepSpeed is >= 0.19.3",
        stages=("init_end", "train"),
    ),
    Rule(
        id="distributed-rl-qlora-no-reentrant",
        title="multi-process RL + QLoRA: non-reentrant",
        kind="require",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: bool(
            f.gc_enabled
            and f.world_size > 1
            and f.rl_trainer
            and f.is_peft
            and (f.quantization or "").startswith("bitsandbytes")
        ),
        condition="more than one process, an RL/preference trainer, a PEFT adapter on a bitsandbytes-quantized model",
        message=(
            "Reentrant checkpointing is broken for distributed RL training with QLoRA (Axolotl refuses it). "
            "Use use_reentrant=False."
        ),
        evidence=(
            "https://github.com/axolotl-ai-cloud/axolotl/blob/main/src/axolotl/utils/schemas/validation.py (seed "
            "001, rule 4)",
        ),
        remove_when="TRL's RL trainers support reentrant checkpointing with QLoRA across processes",
        stages=("init_end", "train"),
    ),
    Rule(
        id="fsdp-not-applied",
        title="FSDP asked for, DDP used",
        kind="check",
        setting="fsdp",
        when=lambda f: f.fsdp_wrapped is False,
        condition=(
            "`fsdp` (or ACCELERATE_USE_FSDP) is set but accelerate's state is not FSDP: it fell back to another "
            "wrapper (DDP), as it does on CPU (`use_cpu=True`)"
        ),
        message=(
            "The model is not sharded: every rank holds all of it, FSDP's own activation checkpointing is not applied, "
            "and DDP's behaviour applies (the plugin judges the run as the DDP run it is). Run on the accelerators "
            "FSDP needs, or drop `fsdp` to say what runs."
        ),
        evidence=(
            "https://github.com/huggingface/accelerate/blob/main/src/accelerate/state.py (AcceleratorState: FSDP only "
            "for accelerator device types)",
            "reproduced: transformers 5.23.0, torchrun 2 procs, fsdp='full_shard' + use_cpu=True -> DDP, silently",
        ),
        remove_when="accelerate refuses FSDP where it cannot apply it",
        stages=("init_end", "train"),
    ),
    Rule(
        id="reused-params-need-non-reentrant",
        title="a block reused across depth under DeepSpeed ZeRO or DDP: non-reentrant",
        kind="require",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: bool(f.gc_enabled and f.shared_block_params and f.reduces_per_parameter),
        condition=(
            "a trainable parameter belongs to two or more checkpointed blocks (Zamba2's shared block), under "
            "DeepSpeed ZeRO-2, ZeRO-3, ZeRO-1 with `overlap_comm`, or torch DDP without `ddp_static_graph`"
        ),
        message=(
            "Reentrant checkpointing runs one inner backward per checkpointed call, so the shared parameter's gradient "
            "hook fires twice in one backward: ZeRO-1/2 raise 'Gradient computed twice for this partition', DDP "
            "'Expected to mark a variable ready only once', and ZeRO-3 silently keeps one of the two gradients. "
            "Non-reentrant accumulates once. Use use_reentrant=False (under DDP, ddp_static_graph=True works too)."
        ),
        evidence=(
            "https://github.com/deepspeedai/DeepSpeedExamples/issues/458",
            "reproduced: DeepSpeed 0.19.8, 2 ranks on CPU, Zamba2 through the Trainer: ZeRO-2 and ZeRO-1+overlap_comm "
            "AssertionError, ZeRO-3 wrong update, DDP 'marked ready only once'; non-reentrant equals no checkpointing",
        ),
        remove_when="never while reentrant checkpointing runs one backward per call",
        stages=("init_end", "train"),
    ),
    Rule(
        id="ddp-reentrant-find-unused",
        title="DDP looking for unused parameters: non-reentrant",
        kind="require",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: f.gc_enabled and f.ddp_find_unused,
        condition=(
            "torch DDP (several processes, no DeepSpeed/FSDP) that will look for unused parameters: "
            "`ddp_find_unused_parameters=True`, or unset with a model that is not a `PreTrainedModel` (a `PeftModel`), "
            "and no `ddp_static_graph`"
        ),
        message=(
            "Reentrant checkpointing runs each block's backward inside autograd's, so DDP sees its parameters become "
            "ready twice: `RuntimeError: Expected to mark a variable ready only once` in the first backward. Use "
            "use_reentrant=False, or ddp_find_unused_parameters=False, or ddp_static_graph=True (transformers 5)."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/pull/4659#issuecomment-643356021",
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/trainer.py "
            "(_build_accelerator_args: find_unused_parameters)",
            "reproduced: torchrun 2 procs gloo, reentrant + find_unused -> 'Expected to mark a variable ready only "
            "once'",
        ),
        remove_when="never while torch DDP and reentrant checkpointing work this way",
    ),
    Rule(
        id="non-reentrant-only-kwargs",
        title="context_fn / debug / determinism_check / respect_saved_tensors_hooks: non-reentrant only",
        kind="require",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: bool(f.gc_enabled and (f.selective or _non_reentrant_only(f))),
        condition=(
            "the checkpointing kwargs hold `context_fn` (selective per-op checkpointing), `debug`, "
            "`determinism_check` or `respect_saved_tensors_hooks` (torch 2.14+), or TRL's `selective: true`"
        ),
        message=(
            "Only torch's non-reentrant implementation has them: with use_reentrant=True, `context_fn`, `debug=True` "
            "and `respect_saved_tensors_hooks` raise '... is only supported when use_reentrant=False' in the first "
            "forward, and `determinism_check` is silently ignored. Use use_reentrant=False."
        ),
        evidence=(
            TORCH_CHECKPOINT_DOCS,
            "reproduced: torch 2.13, GPT-2, use_reentrant=True + context_fn -> ValueError in the first forward",
            "reproduced: torch 2.14.1 and 2.15.0, use_reentrant=True + respect_saved_tensors_hooks -> ValueError",
        ),
        remove_when="torch's reentrant checkpoint accepts these options",
    ),
    Rule(
        id="shared-layer-state-needs-non-reentrant",
        title="layers sharing state: non-reentrant",
        kind="require",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: bool(f.gc_enabled and f.shared_state_layers),
        condition=(
            "some layers read tensors another layer computed outside their inputs: cross-layer KV sharing "
            "(`num_kv_shared_layers` > 0, Gemma 4)"
        ),
        message=(
            "Reentrant checkpointing runs the forward under no_grad, so the KV states a layer stores for later layers "
            "carry no graph: the gradients through the shared states are lost and the others are wrong, silently (the "
            "gradient audit sees gradients and passes). Non-reentrant is exact. Use use_reentrant=False."
        ),
        evidence=(
            "https://github.com/unslothai/unsloth-zoo/pull/813 (Gemma 3n / Gemma 4 KV sharing under checkpointing)",
            "reproduced: transformers 5.23.0, Gemma 4 text, 4 layers, num_kv_shared_layers=2: reentrant gradients "
            "differ from no checkpointing (max relative difference 0.52); non-reentrant equal",
        ),
        versions={"transformers": ">=5.0"},
        needs={"none_kwargs_reentrant": False},
        remove_when="transformers passes shared KV states as checkpoint inputs",
        stages=("init_end", "train"),
    ),
    Rule(
        id="shared-layer-state-prefers-non-reentrant",
        title="layers sharing state: non-reentrant preferred (not reproduced on 4.x)",
        kind="prefer",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: bool(f.gc_enabled and f.shared_state_layers),
        condition="as `shared-layer-state-needs-non-reentrant`, on transformers 4.x (Gemma 3n)",
        message=(
            "Reported for Gemma 3n's KV sharing (unsloth-zoo PR 813) but not reproduced here: transformers 4.57.6 "
            "Gemma 3n with num_kv_shared_layers=2 gave reentrant gradients equal to no checkpointing. Kept with a "
            "warning rather than refused; use_reentrant=False is exact either way."
        ),
        evidence=(
            "https://github.com/unslothai/unsloth-zoo/pull/813",
            "not reproduced: transformers 4.57.6, Gemma 3n text, 4 layers, num_kv_shared_layers=2 (equal gradients)",
        ),
        versions={"transformers": "<5.0"},
        needs={"none_kwargs_reentrant": True},
        remove_when="transformers 4.x is no longer supported",
        stages=("init_end", "train"),
    ),
    Rule(
        id="preserve-rng-state-with-dropout",
        title="dropout needs the RNG state preserved",
        kind="require",
        setting="preserve_rng_state",
        value=True,
        when=lambda f: bool(f.gc_enabled and f.dropout and f.preserve_rng_state is False),
        condition=(
            "`preserve_rng_state=False` in the checkpointing kwargs and some dropout probability of the model > 0, or "
            "a module's router jitter > 0 (Mixtral's `router_jitter_noise`)"
        ),
        message=(
            "The recompute draws other dropout masks (or router noise) than the forward did, so the gradients do not "
            "belong to the loss that was computed: silently wrong (no error, the audit sees gradients). Keep "
            "preserve_rng_state=True (torch's default) or set every dropout and jitter to 0."
        ),
        evidence=(
            "https://github.com/allenai/OLMo-core/pull/828",
            "reproduced: torch 2.13, GPT-2 with dropout 0.1, preserve_rng_state=False: gradients differ from no "
            "checkpointing (max relative difference 1.23), reentrant and non-reentrant; True: equal",
            "reproduced: Mixtral with router_jitter_noise=0.1, preserve_rng_state=False: max relative difference 0.47, "
            "both use_reentrant values, transformers 5.23.0 (4.57.6, non-reentrant: CheckpointError, the routed "
            "shapes differ); True: equal; Qwen3-MoE, whose config accepts the key and never uses it: equal",
            TORCH_CHECKPOINT_DOCS,
        ),
        remove_when="never while recomputation replays random ops",
        stages=("init_end", "train"),
    ),
    Rule(
        id="fsdp2-checkpointing-with-dropout",
        title="FSDP2's own checkpointing does not preserve the RNG state",
        kind="require",
        setting="fsdp_activation_checkpointing",
        value=False,
        when=lambda f: bool(f.fsdp_activation_checkpointing and f.fsdp_version == 2 and f.dropout),
        condition=(
            "FSDP2 with its own activation checkpointing (`fsdp_config['activation_checkpointing']`) and dropout > 0"
        ),
        message=(
            "accelerate wraps every layer for FSDP2 with `preserve_rng_state=False`, so the recompute draws other "
            "dropout masks than the forward did: wrong gradients, silently. Use the Trainer's checkpointing instead "
            "(gradient_checkpointing=True, fsdp_config activation_checkpointing=False; fix mode switches to it), or "
            "set every dropout to 0."
        ),
        evidence=(
            "https://github.com/huggingface/accelerate/blob/main/src/accelerate/utils/fsdp_utils.py "
            "(fsdp2_apply_ac: checkpoint_wrapper(..., preserve_rng_state=False))",
            "reproduced: real FSDP2 on CPU (torchrun 2 procs, gloo), attention_dropout=0.1: 81% of the first update's "
            "elements differ from no checkpointing; FSDP1's and the Trainer's checkpointing are exact",
        ),
        remove_when="accelerate preserves the RNG state in FSDP2's activation checkpointing",
        stages=("init_end", "train"),
    ),
    Rule(
        id="fsdp2-mixed-precision-recompute",
        title="FSDP2 mixed precision: this torch recomputes in another dtype",
        kind="check",
        setting="torch",
        when=lambda f: bool(
            f.fsdp
            and f.fsdp_version == 2
            and f.mixed_precision
            and (f.gc_enabled or (f.fsdp_activation_checkpointing and f.dropout))
        ),
        condition=(
            "FSDP2 with mixed precision (bf16 / fp16), the Trainer's checkpointing on (or FSDP's own with dropout, "
            "which fix mode switches to the Trainer's), and a torch whose FSDP2 skips its casts when a checkpointed "
            "block is recomputed (read in its source)"
        ),
        message=(
            "This torch's FSDP2 does not cast a recompute's inputs and outputs as it cast the forward's, so "
            "transformers' checkpointing recomputes in float32 what the forward ran in bfloat16, and the first "
            "backward stops with a CheckpointError ('Recomputed values for the following tensors have different "
            "metadata'). Upgrade torch to 2.13 or later, or train without mixed precision."
        ),
        evidence=(
            "https://github.com/pytorch/pytorch/issues/159359 (dtype mismatch in recomputed activations: FSDP2's "
            "_pre_forward skips the cast in PRE_BACKWARD)",
            "https://github.com/NVIDIA-NeMo/Automodel/issues/3504 (the same with torch 2.11 / 2.12; fixed in torch "
            "2.13.0: FSDPState._pre_forward / _post_forward cast in the PRE_BACKWARD branch)",
            "read: torch 2.13.0, 2.14.1, 2.15.0 have the casts (capabilities.detect_fsdp2_recompute_casts); not "
            "reproduced here (no torch before 2.13 in this project's environments)",
        ),
        versions={"torch": "<2.13"},
        needs={"fsdp2_recompute_casts": False},
        remove_when="the plugin's floor torch is 2.13 or later",
        stages=("init_end", "train"),
    ),
    Rule(
        id="offload-needs-accelerator",
        title="activation offloading needs an accelerator",
        kind="require",
        setting="offload",
        value=False,
        when=lambda f: bool(f.gc_enabled and f.offload and f.accelerator_built is False),
        condition="`offload: true` in the checkpointing kwargs and a torch built without an accelerator backend",
        message=(
            "transformers wraps the checkpoint in `save_on_cpu(pin_memory=True)`, which raises 'pin_memory=True "
            "requires a CUDA or other accelerator backend' in the first forward where torch was built without one; "
            "the activations are already in host memory, so there is nothing to offload. Drop `offload`."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/modeling_utils.py "
            "(_activation_checkpointing_enable: save_on_cpu(pin_memory=True))",
            "reproduced: transformers 5.23.0, torch 2.13.0+cpu, offload=True -> RuntimeError in the first forward; "
            "with torch 2.14.1 and 2.15.0 (CUDA builds) on a machine without a GPU it trains",
            "https://github.com/huggingface/transformers/blob/v5.17.0/src/transformers/modeling_utils.py "
            "(gradient_checkpointing_enable(offload=True): the same save_on_cpu(pin_memory=True), first in 5.17.0)",
        ),
        versions={"transformers": ">=5.17"},
        needs={"offload": True},
        remove_when="transformers skips offloading without an accelerator",
        stages=("init_end", "train"),
    ),
    Rule(
        id="layer-kwargs-unsupported",
        title="every_n_layers / offload the installed transformers does not read",
        kind="repair",
        setting="checkpointing_kwargs",
        when=lambda f: bool(f.gc_enabled and unread_layer_kwargs(f)),
        condition=(
            "`every_n_layers` (read by transformers from 5.16) or `offload` (from 5.17) in the checkpointing kwargs, "
            "and the installed transformers cannot read it (no such parameter of `gradient_checkpointing_enable`)"
        ),
        message=(
            "A transformers that does not know them passes them to torch.utils.checkpoint: non-reentrant silently "
            "ignores them (every layer checkpointed, nothing offloaded), reentrant raises 'Unexpected keyword "
            "arguments' in the first forward. The plugin takes them out of the kwargs torch gets and applies "
            "every_n_layers itself (per-layer flags, kept across TRL's per-step re-enables); offloading needs "
            "transformers >= 5.17."
        ),
        evidence=(
            "reproduced: transformers 4.57.6, every_n_layers=2: non-reentrant checkpoints every layer, reentrant "
            "raises ValueError: Unexpected keyword arguments: every_n_layers",
            "https://github.com/huggingface/transformers/blob/v5.16.0/src/transformers/trainer.py (pops every_n_layers "
            "before enabling; offload stays in the kwargs)",
            "https://github.com/huggingface/transformers/blob/v5.17.0/src/transformers/trainer.py (pops every_n_layers "
            "and offload before enabling)",
        ),
        versions={"transformers": "<5.17"},
        remove_when="the minimum supported transformers is >= 5.17",
    ),
    Rule(
        id="deepspeed-activation-checkpointing-ignored",
        title="DeepSpeed's activation_checkpointing block does nothing here",
        kind="check",
        setting="deepspeed.activation_checkpointing",
        when=lambda f: f.deepspeed_activation_checkpointing,
        condition=(
            "the DeepSpeed config has an `activation_checkpointing` block (`partition_activations`, "
            "`cpu_checkpointing`, ...)"
        ),
        message=(
            "Hugging Face models checkpoint through transformers (torch.utils.checkpoint), never through "
            "deepspeed.checkpointing, so that block is not applied: no activation is partitioned or moved to the CPU. "
            "Turn checkpointing on with gradient_checkpointing=True and remove the block to avoid the confusion."
        ),
        evidence=(
            "https://github.com/deepspeedai/DeepSpeed/issues/5704 (a DeepSpeed maintainer: the block only applies to "
            "models that call deepspeed.checkpointing)",
            "reproduced: DeepSpeed 0.19.8 + Trainer with the block: deepspeed.checkpointing is never configured",
        ),
        remove_when="transformers routes checkpointing through deepspeed.checkpointing under DeepSpeed",
        stages=("post_init", "init_end"),
    ),
    Rule(
        id="frozen-inputs-need-non-reentrant",
        title="frozen inputs + reentrant = no gradients",
        kind="require",
        setting=USE_REENTRANT,
        value=False,
        when=_frozen_inputs,
        condition=(
            "checkpointing on, trainable parameters inside checkpointed blocks, and their inputs certainly do not "
            "require grad: no trainable parameter and no forward hook outside the blocks except an untied output "
            "head, and no input-require-grad hook now or from the Trainer (LoRA/QLoRA without "
            "`enable_input_require_grads()` on transformers 4.x). Anything that may feed the blocks (learned "
            "positions, embedding norms, token types, a vision tower) leaves the verdict to `frozen-inputs-observed`"
        ),
        message=(
            "With use_reentrant=True, a checkpointed block whose inputs do not require grad produces outputs that do "
            "not require grad, so every trainable parameter inside it silently gets no gradient (torch only warns "
            "'None of the inputs have requires_grad=True'). Set use_reentrant=False, or keep reentrant and call "
            "`model.enable_input_require_grads()` before training."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/issues/21381",
            "https://github.com/axolotl-ai-cloud/axolotl/blob/main/src/axolotl/utils/schemas/validation.py "
            "(check_use_reentrant_mismatch; seed 001, rule 1)",
            "reproduced: transformers 4.57.6 Trainer, frozen embeddings, use_reentrant unset -> 0/18 layer params "
            "change",
            TORCH_CHECKPOINT_DOCS,
        ),
        remove_when="never while torch keeps the reentrant variant's requires-grad semantics",
        stages=("init_end", "train"),
    ),
    Rule(
        id="alora-needs-input-grads",
        title="aLoRA: the checkpointed layers' inputs must require grad",
        kind="repair",
        setting="inputs_require_grad",
        value=True,
        when=lambda f: bool(f.gc_enabled and f.alora and f.inputs_require_grad is not True),
        condition=(
            "checkpointing on, a PEFT aLoRA adapter (`alora_invocation_tokens`), and the hidden states entering the "
            "checkpointed layers do not certainly require grad (no `enable_input_require_grads()` hook: transformers "
            "4.x, where neither the enable call nor the Trainer adds it for a PEFT model)"
        ),
        message=(
            "PEFT passes aLoRA's offsets to the recompute through hooks it removes from a full backward hook on each "
            "checkpointed layer; with no layer input requiring grad, that hook fires before the recompute, so the "
            "recomputed layers apply the adapter to no token: CheckpointError ('Recomputed values ... have different "
            "metadata') with use_reentrant=False, and with True the frozen-inputs RuntimeError. The plugin calls "
            "`enable_input_require_grads()` on the model, as transformers 5 does when it enables checkpointing "
            "(a Trainer run takes it off again at train end); gradients are then exact under either value."
        ),
        evidence=(
            "https://github.com/huggingface/peft/issues/2826 (aLoRA with gradient checkpointing)",
            "https://github.com/huggingface/peft/pull/2860 (the recompute's offset hooks, removed by a full backward "
            "hook on the checkpointed layer)",
            "reproduced: transformers 4.57.6, peft 0.21.2, Trainer and a plain loop, aLoRA on a tiny Llama: "
            "use_reentrant=False raises CheckpointError at the first backward, True RuntimeError; with the input "
            "hook both match no checkpointing; transformers 5.23.0 trains (its enable call adds the hook)",
        ),
        versions={"transformers": ">=4.52.1,<5", "peft": ">=0.17"},
        remove_when="PEFT keeps aLoRA's offsets for the recompute without relying on the layer inputs' gradients",
        stages=("init_end", "train"),
    ),
    Rule(
        id="quantized-prefers-non-reentrant",
        title="quantized models: non-reentrant",
        kind="prefer",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: bool(f.gc_enabled and f.quantization),
        condition="checkpointing on a quantized model (bitsandbytes 4/8-bit, GPTQ, AWQ, HQQ, torchao, ...)",
        message=(
            "PEFT's prepare_model_for_kbit_training needs the input-require-grad hack only with reentrant "
            "checkpointing; non-reentrant needs no hack and handles the frozen quantized weights."
        ),
        evidence=(
            "https://github.com/huggingface/peft/blob/main/src/peft/utils/other.py (prepare_model_for_kbit_training; "
            "seed 002)",
        ),
        versions={"transformers": ">=4.35"},
        remove_when="PEFT drops the reentrant path of prepare_model_for_kbit_training",
        stages=("init_end", "train"),
    ),
    Rule(
        id="non-reentrant-default",
        title="default to non-reentrant",
        kind="prefer",
        setting=USE_REENTRANT,
        value=False,
        when=lambda f: f.gc_enabled,
        condition="checkpointing on",
        message=(
            "Non-reentrant checkpointing is PyTorch's recommended variant and correct for frozen inputs, PEFT and "
            "hooks; transformers < 5.0 defaults to reentrant. The value is written explicitly so every code path "
            "(Trainer, TRL's per-step re-enables, `{}` which 4.x and 5.x read differently) agrees. "
            "A value you set is kept."
        ),
        evidence=(
            "https://github.com/huggingface/trl/blob/v1.16.0/trl/trainer/grpo_trainer.py (setdefault "
            "use_reentrant=False for transformers<5; seed 000)",
            "https://github.com/huggingface/transformers/pull/43203",
            TORCH_CHECKPOINT_DOCS,
        ),
        remove_when="the minimum supported transformers is >= 5.0 and no trainer passes `{}`",
    ),
    Rule(
        id="model-kwargs-stale",
        title="the live model runs the decided mode",
        kind="repair",
        setting="model.use_reentrant",
        when=lambda f: bool(f.model_gc_enabled),
        condition="checkpointing is already enabled on the model with a `use_reentrant` other than the decided one",
        message=(
            "Checkpointing enabled before the Trainer runs (TRL <= 0.26 `prepare_peft_model`, PEFT "
            "`prepare_model_for_kbit_training`, user code) keeps its own kwargs, and when it also sets "
            "`args.gradient_checkpointing=False` the Trainer never re-enables it. The plugin rewrites the checkpoint "
            "function of every checkpointed module in place (no new hooks)."
        ),
        evidence=(
            "https://github.com/huggingface/trl/blob/v0.26.2/trl/models/utils.py (enable_gradient_checkpointing "
            "ignores the kwargs; prepare_peft_model sets args.gradient_checkpointing=False for QLoRA)",
        ),
        remove_when="TRL <= 0.26 is no longer supported and PEFT takes its kwargs from the Trainer",
        stages=("init_end", "train"),
        level="info",
    ),
    Rule(
        id="use-cache-off",
        title="no KV cache while training with checkpointing",
        kind="prefer",
        setting="model.config.use_cache",
        value=False,
        when=lambda f: bool((f.gc_enabled or f.fsdp_activation_checkpointing) and f.use_cache and not f.generates),
        condition=(
            "checkpointing on (the Trainer's or FSDP's own), `use_cache` True in some config the model reads (the "
            "top-level one or a sub-model's: `text_config`, `decoder`...), and the trainer does not generate during "
            "training"
        ),
        message=(
            "A KV cache is useless in a training forward and incompatible with recomputation: transformers drops it "
            "per layer with a warning when it checkpoints, but under FSDP's own activation checkpointing the layers "
            "keep writing it and the recompute sees a longer cache: CheckpointError. The plugin turns it off in "
            "every config for the training steps only; checkpoints and the model after training keep yours."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/issues/34928",
            "reproduced: transformers 4.57.6, decoder layers wrapped by torch's checkpoint_wrapper (what FSDP's "
            "activation checkpointing does) + use_cache=True -> CheckpointError in the backward; use_cache=False "
            "trains",
            "https://github.com/axolotl-ai-cloud/axolotl (seed 001, rule 5)",
            "https://github.com/OpenRLHF/OpenRLHF (seed 003: use_cache=False with gradient checkpointing)",
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/modeling_layers.py "
            "(GradientCheckpointingLayer)",
        ),
        remove_when="transformers stops building a cache in training forwards",
        stages=("init_end",),
        level="info",
    ),
    Rule(
        id="frozen-inputs-observed",
        title="a block ran reentrant with inputs that do not require grad",
        kind="verify",
        setting="use_reentrant",
        value=False,
        condition=(
            "first training forward of each checkpointing stack (decoder, encoder, vision or audio tower): a "
            "checkpointed call ran with use_reentrant=True, its module holds trainable parameters, and none of its "
            "positional tensor inputs requires grad. Seen by one-shot hooks that are gone after the first step"
        ),
        message=(
            "Reentrant checkpointing returns outputs that do not require grad when none of its inputs does, so the "
            "block's trainable parameters get no gradient (torch only warns 'None of the inputs have "
            "requires_grad=True'). A value you set: strict mode raises before the backward; fix mode makes this call's "
            "input require grad and switches to use_reentrant=False for the rest of the run; warn mode logs. A value "
            "the trainer or the library default chose is repaired the same way in strict mode. Keep reentrant by "
            "calling `model.enable_input_require_grads()` (transformers 4.x hooks only the top-level input embeddings, "
            "not a vision tower's)."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/issues/21381",
            "https://docs.pytorch.org/docs/stable/checkpoint.html (reentrant: at least one input must require grad)",
            "reproduced: transformers 4.57.6, reentrant, frozen input embeddings -> 0/18 layer parameters train",
        ),
        remove_when="never while torch keeps the reentrant variant's requires-grad semantics",
    ),
    Rule(
        id="reentrant-keyword-inputs",
        title="reentrant blocks sharing a keyword tensor that requires grad",
        kind="verify",
        setting="use_reentrant",
        value=False,
        condition=(
            "first training forward: reentrant-checkpointed blocks get a tensor that requires grad as a keyword "
            "argument (transformers binds keyword arguments into the checkpointed function), and a second block "
            "gets the same tensor (e.g. `encoder_hidden_states` for every decoder layer of Whisper on 4.57)"
        ),
        message=(
            "Reentrant checkpointing only sees positional inputs; a keyword tensor's graph is backpropagated from "
            "inside each block's own backward and freed, so the second block raises 'Trying to backward through the "
            "graph a second time'. A value you set: strict refuses before the backward, fix runs the blocks "
            "non-reentrant (exact); a value you did not set is switched to use_reentrant=False at once."
        ),
        evidence=(
            "reproduced: transformers 4.57.6 Whisper (decoder layers get encoder_hidden_states by keyword), "
            "use_reentrant=True -> RuntimeError: Trying to backward through the graph a second time; 5.23.0 passes it "
            "positionally and trains",
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/modeling_layers.py "
            "(GradientCheckpointingLayer: inputs that require grad must be passed positionally with "
            "use_reentrant=True)",
        ),
        remove_when="never while torch's reentrant checkpoint ignores keyword inputs",
    ),
    Rule(
        id="two-forwards-before-backward",
        title="two forwards before one backward under DeepSpeed ZeRO or DDP",
        kind="verify",
        setting="use_reentrant",
        value=False,
        condition=(
            "first training step: a second grad-enabled forward of the model before the first backward (a custom "
            "`compute_loss` calling the model twice), with reentrant checkpointing, under DeepSpeed ZeRO-2, ZeRO-3, "
            "ZeRO-1 with `overlap_comm`, or DDP without `ddp_static_graph`"
        ),
        message=(
            "Every checkpointed block's parameters then get gradients from two inner backwards: ZeRO-1/2 raise "
            "'Gradient computed twice for this partition', DDP 'Expected to mark a variable ready only once', ZeRO-3 "
            "silently keeps one. The first forward already ran reentrant, so even fix mode can only refuse: use "
            "use_reentrant=False. (No TRL 1.16 trainer does this: their reference passes run under no_grad.)"
        ),
        evidence=(
            "https://github.com/deepspeedai/DeepSpeedExamples/issues/458",
            "reproduced: DeepSpeed 0.19.8, 2 ranks on CPU, a Trainer whose compute_loss calls the model twice: ZeRO-2 "
            "AssertionError; non-reentrant equals no checkpointing",
        ),
        remove_when="never while reentrant checkpointing runs one backward per call",
    ),
    Rule(
        id="forward-state-replayed",
        title="state written in a checkpointed forward is written again by its recompute",
        kind="verify",
        setting="activation_checkpointing",
        condition=(
            "first training step: between the end of the first training forward and the end of its backward, a "
            "checkpointed block's buffer changed (its version and its values) or a public number attribute of one of "
            "its modules changed: the recompute replayed a side effect of the forward. The parity probe then compares "
            "the first step's gradients with no checkpointing (one process, unsharded): where they differ, the block's "
            "output reads that state, and strict mode refuses before any update"
        ),
        message=(
            "Checkpointing runs the block's forward again in the backward, so counters, MoE tokens-per-expert and "
            "running statistics count every batch twice, silently (and a loss or output that reads them differs from "
            "the forward's). Update them outside the checkpointed block (in the loss, or once per optimizer step), "
            "or skip the update while recomputing, or leave that block out of checkpointing. Where the output reads "
            "the state, the recompute computes another function than the forward: wrong gradients."
        ),
        evidence=(
            "https://github.com/pytorch/torchtitan/pull/1593 (tokens per expert counted twice during full recompute)",
            "https://github.com/pytorch/torchtitan/pull/4772 (recomputation would advance rolling expert counts)",
            "reproduced: transformers 5.23.0 and 4.57.6, torch 2.13.0, tiny Llama whose decoder layers count tokens "
            "in a buffer or an int attribute: with checkpointing (use_reentrant True or False) the count after one "
            "step is twice the count without; whose input is scaled by that count: the first step's gradients differ "
            "from no checkpointing (Llama, GPT-2; tests/test_replay.py)",
        ),
        versions={"torch": ">=2.1"},
        remove_when="when torch.utils.checkpoint tells a forward it is recomputing (no public flag in torch 2.13)",
    ),
    Rule(
        id="torch-compile-first-step",
        title="torch.compile: the first step's forward hooks stand aside",
        kind="check",
        setting="first_step_checks",
        when=lambda f: f.gc_enabled and f.compiled is not None,
        detail=lambda f: f"{f.compiled}:",
        condition=(
            "checkpointing on, and the forward runs under torch.compile (`torch_compile=True` in the arguments or "
            "the config, `ACCELERATE_DYNAMO_BACKEND`, a model compiled in place or wrapped by `torch.compile`)"
        ),
        message=(
            "The first-step checks that hook the forward (the first-forward observation, the replayed-state check, two "
            "forwards before one backward, the parity probe's first inputs, the memory plan) are not installed, so the "
            "compiled graph is the one without the plugin (measured: with them, 5 graph breaks and 5 graphs for 1). "
            "The gradient audit still reads the gradients after the first backward; the parity probe runs only with "
            "parity_check=True, on a synthetic batch; the memory plan is off (the estimate runs the eager forward)."
        ),
        evidence=(
            "https://github.com/pytorch/pytorch/issues/166926 (checkpointing under torch.compile)",
            "measured: transformers 5.23.0, torch 2.13.0, Trainer(torch_compile=True, torch_compile_backend="
            "'aot_eager'), tiny Llama, both use_reentrant values: 0 graph breaks and 1 graph without the plugin, 5 "
            "and 5 with its forward hooks, 0 and 1 with this rule",
        ),
        remove_when="the plugin's first-step hooks are traceable by dynamo without a graph break",
        stages=("init_end", "train"),
        level="info",
    ),
    Rule(
        id="context-parallel-backward-in-context",
        title="context parallelism: the recompute runs where the backward runs",
        kind="check",
        setting="parallelism_config.cp_size",
        when=lambda f: f.gc_enabled and f.cp_size > 1,
        detail=lambda f: f"Context parallelism (cp_size={f.cp_size}):",
        condition=(
            "checkpointing on and accelerate's context-parallel size above 1 (`parallelism_config.cp_size` in the "
            "arguments, an accelerate config's `parallelism_config` block, Axolotl's `context_parallel_size`)"
        ),
        message=(
            "checkpointing recomputes each block in the backward, and the attention it recomputes is sharded only "
            "inside accelerate's `maybe_context_parallel` context. The Trainer (and every TRL trainer that calls its "
            "`training_step`) runs the backward inside it, so the recompute matches the forward. A `training_step` "
            "override or a loop that calls backward after leaving the context recomputes unsharded attention and stops "
            "with CheckpointError ('Recomputed values ... have different metadata'): keep `accelerator.backward(loss)` "
            "inside `with accelerator.maybe_context_parallel(...)`. The parity probe and the runtime memory plan skip "
            "these sharded runs."
        ),
        evidence=(
            "https://github.com/huggingface/trl/issues/4314 (a trainer that left the context before the backward: "
            "CheckpointError, saved [1, 8, 24920, 128] vs recomputed [1, 8, 12460, 128])",
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/trainer.py (training_step: "
            "compute_loss and accelerator.backward inside `with cp_context()`; the same in 4.57.6, 5.17.0, 5.24.0; "
            "no context parallelism in 4.53.2)",
            "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate/accelerator.py "
            "(maybe_context_parallel: its example runs the backward inside the context)",
            "not reproduced here: torch 2.13's context-parallel dispatcher replaces only the CUDA SDPA kernels "
            "(flash, efficient, cuDNN), so it needs GPUs",
        ),
        versions={"transformers": ">=4.57", "accelerate": ">=1.10"},
        remove_when="torch's checkpoint recomputes under the context the forward ran in",
        stages=("init_end", "train"),
        level="info",
    ),
    Rule(
        id="checkpoint-wrapper-zero3-saved-keys",
        title="checkpoint_wrapper + ZeRO-3: saved weights carry `_checkpoint_wrapped_module`",
        kind="check",
        setting="checkpoint_wrapper",
        when=lambda f: bool(f.checkpoint_wrapped and f.zero_stage == 3),
        condition=(
            "blocks wrapped by torch's `checkpoint_wrapper` (`apply_activation_checkpointing`; Axolotl's activation "
            "offloading on a full fine-tune) under DeepSpeed ZeRO-3"
        ),
        message=(
            "ZeRO-3 gathers the 16-bit weights for `save_model` by walking the module tree, where the wrapper adds "
            "`_checkpoint_wrapped_module.` to every block's keys (torch strips it only from `state_dict()`): the saved "
            "model's block weights do not load with `from_pretrained`, which initialises those layers anew. Strip "
            "`_checkpoint_wrapped_module.` from the saved keys, or save from an unwrapped copy. The plugin changes "
            "nothing."
        ),
        evidence=(
            "https://github.com/axolotl-ai-cloud/axolotl/issues/3166 (DeepSpeed + activation_offloading: wrong keys "
            "in the saved weights)",
            "reproduced: transformers 5.23.0, DeepSpeed 0.19.8 ZeRO-3 on CPU, torchrun 1 process, a tiny Llama with "
            "apply_activation_checkpointing on its decoder layers, Trainer.save_model: 18 of 21 saved keys hold "
            "`_checkpoint_wrapped_module`; 0 of 21 without DeepSpeed",
        ),
        versions={"deepspeed": ">=0.14", "torch": ">=2.1"},
        remove_when="DeepSpeed's consolidated 16-bit state dict honours the modules' state_dict hooks",
        stages=("init_end", "train"),
    ),
    Rule(
        id="ddp-unused-parameters",
        title="DDP without find_unused_parameters: every trainable parameter needs a gradient",
        kind="verify",
        setting="ddp_find_unused_parameters",
        value=True,
        condition=(
            "first optimizer step, before the update: torch DDP (several processes, no DeepSpeed or FSDP) without "
            "`find_unused_parameters` and without `ddp_static_graph` (the Trainer's default with checkpointing on), "
            "and a trainable parameter got no gradient (an unfrozen vision tower a text batch does not reach, an "
            "unused head or expert)"
        ),
        message=(
            "their buckets are never reduced, so this step's update differs across ranks, and DDP stops the next "
            "forward with 'Expected to have finished reduction in the prior iteration'. The Trainer turns "
            "find_unused_parameters off when checkpointing is on (reentrant checkpointing crashes with it). Use "
            "ddp_find_unused_parameters=True with use_reentrant=False, or ddp_static_graph=True, or freeze the "
            "parameters the loss does not use."
        ),
        evidence=(
            "https://github.com/hiyouga/LLaMA-Factory/issues/5680 (an unfrozen vision tower under DDP)",
            "https://github.com/unslothai/unsloth/issues/3713",
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/trainer.py "
            "(find_unused = not activation checkpointing, for a PreTrainedModel)",
            "reproduced: torchrun 2 processes (gloo, CPU), transformers 5.23.0, a trainable module the loss never "
            "reaches: without the plugin the second step raises 'Expected to have finished reduction'; with "
            "ddp_find_unused_parameters=True and use_reentrant=False it trains",
        ),
        remove_when="never while DDP needs every parameter's gradient without find_unused_parameters",
    ),
    Rule(
        id="checkpointing-not-running",
        title="checkpointing asked for, not running",
        kind="verify",
        setting="activation_checkpointing",
        value=True,
        condition=(
            "at train begin no block has checkpointing switched on although the arguments ask for it, or the first "
            "training forward ran no checkpointed block (the model was in eval mode: transformers checkpoints only "
            "in train mode)"
        ),
        message=(
            "The run uses the memory of a run without checkpointing (out-of-memory where you did not expect it). "
            "Check what switches it off (a re-enable with other arguments, `model.eval()` in a custom training step, "
            "a model that does not support it)."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/modeling_layers.py "
            "(GradientCheckpointingLayer: `if self.gradient_checkpointing and self.training`)",
            "reproduced: a Trainer whose compute_loss calls model.eval() recomputes no block",
        ),
        remove_when="never: it checks the outcome",
    ),
    Rule(
        id="checkpointing-unasked",
        title="checkpointing running, not asked for",
        kind="verify",
        setting="activation_checkpointing",
        value=False,
        condition=(
            "at train begin blocks have checkpointing switched on although the arguments do not ask for it "
            "(PEFT's `prepare_model_for_kbit_training` and some TRL releases switch it on by themselves)"
        ),
        message=(
            "Every checkpointed block is recomputed in the backward: the run is slower than one without "
            "checkpointing (+20-35% per step in this project's benchmark). If you want it, say so with "
            "gradient_checkpointing=True; if not, `prepare_model_for_kbit_training(model, "
            "use_gradient_checkpointing=False)`."
        ),
        evidence=(
            "https://github.com/huggingface/peft/blob/main/src/peft/utils/other.py (prepare_model_for_kbit_training: "
            "use_gradient_checkpointing=True by default)",
            "reproduced: PEFT 0.21.2 prepare_model_for_kbit_training + gradient_checkpointing=False: every block "
            "recomputed",
        ),
        remove_when="never: it checks the outcome",
        level="info",
    ),
    Rule(
        id="gradient-audit",
        title="every checkpointed block got gradients",
        kind="verify",
        setting="gradients",
        condition=(
            "first optimizer step (before `optimizer.step()` and `zero_grad`): a checkpointed block with trainable "
            "parameters none of which received a gradient; judged per block, so one unused expert or branch is fine. "
            "It is blamed on checkpointing only with evidence (the first forward saw it run reentrant with inputs "
            "that did not require grad); otherwise it is reported once, at INFO (e.g. the last vision layer of a "
            "LLaVA model with `vision_feature_layer=-2`, which the loss does not use); a block whose trainable "
            "parameters all got zeros is reported too. Both start the parity probe. Covers blocks "
            "checkpointed through transformers (`GradientCheckpointingLayer`, `_gradient_checkpointing_func`); a "
            "custom module calling `torch.utils.checkpoint` itself is not seen. Skipped under DeepSpeed/FSDP "
            "(sharded gradients). Off with `SafeGCCallback(audit=False)` or `TRL_GC_PLUGIN_AUDIT=0`"
        ),
        message=(
            "Checkpointed blocks with trainable parameters got no gradient. When the first forward saw them run "
            "reentrant with inputs that do not require grad, checkpointing is the cause: strict mode raises before "
            "the first optimizer step, fix mode switches to non-reentrant for the following steps, warn mode logs. "
            "Otherwise they are reported, never refused, and compared with no checkpointing by the parity probe "
            "(rule parity-check), which tells a loss that does not use them from a recompute that differs."
        ),
        evidence=(
            "https://github.com/huggingface/transformers/issues/21381",
            "https://github.com/huggingface/trl/issues/1936 (LLaVA: the last vision layer gets no gradient)",
            "reproduced: transformers 4.57.6, reentrant, frozen/detached embeddings -> no layer gradient",
        ),
        remove_when="never: it checks the outcome, whatever the cause",
    ),
    Rule(
        id="checkpointing-drift",
        title="the decision still holds while training",
        kind="verify",
        setting="use_reentrant",
        condition=(
            "after each step: the args kwargs (both names, one object) and the live checkpoint function no longer "
            "hold the decided `use_reentrant` (DPO/GRPO/KTO/RLOO re-enable checkpointing every step from the args)"
        ),
        message=(
            "Something changed the checkpointing kwargs mid-training; the next re-enable would run them. Repaired in "
            "strict/fix mode, logged in warn mode; the first drift of each kind is logged with before/after."
        ),
        evidence=(
            "https://github.com/huggingface/trl/blob/v1.16.0/trl/models/utils.py (disable_gradient_checkpointing "
            "re-enables with args.gradient_checkpointing_kwargs)",
        ),
        remove_when="never: it checks the outcome",
        level="info",
    ),
    Rule(
        id="input-hook-pileup",
        title="one input-require-grad hook",
        kind="verify",
        setting="input_embeddings.forward_hooks",
        value=1,
        condition=(
            "after each step: more than one `enable_input_require_grads` hook on the input embeddings (transformers 5 "
            "adds one at every enable, and DPO/GRPO re-enable every step)"
        ),
        message="Extra identical hooks cost a call each per forward and grow without bound; the plugin keeps one.",
        evidence=(
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/modeling_utils.py "
            "(_activation_checkpointing_enable -> enable_input_require_grads on every call)",
            "reproduced: transformers 5.23.0 + TRL 1.16.0 GRPO, hooks 3, 5, 7, 9 over 4 steps",
        ),
        versions={"transformers": ">=5.0"},
        needs={"enable_adds_input_hook": True},
        remove_when="transformers stops registering a new hook per enable",
        level="info",
    ),
    Rule(
        id="parity-check",
        title="checkpointed gradients equal plain gradients",
        kind="verify",
        setting="gradients",
        condition=(
            "at the first optimizer step, before any update: one forward/backward with checkpointing and one without "
            "on one sample of the first training batch (text cut to 16 tokens; else the whole first batch up to 8192 "
            "tokens, else a synthetic 16-token sequence); each gradient reduced to 8 random projections (float64) "
            "and freed as autograd produces it; per parameter |diff| <= rtol * |g| (rtol 1e-4, 1e-2 with 16-bit "
            "parameters). With `parity_check=None` (default), in one process without sharding: run for reentrant "
            "runs of any model, and for any run whose gradient audit found a trainable checkpointed block with no "
            "gradient or only zeros; `SafeGCCallback(parity_check=True|False)` forces it"
        ),
        message=(
            "Reports the largest gradient difference; a parameter whose gradient is missing or all zero only under "
            "checkpointing is the silent failure (refused in strict mode). Reentrant is the less verified path (wrong "
            "gradients from shared layer state or keyword inputs pass the audit), so it is checked by default; so is a "
            "run whose audit found a block without a gradient or with zeros only, the failure a recompute that differs "
            "from the forward leaves (a side input a hook set and cleared). Its memory grows with the number of "
            "parameter tensors, not their size (no gradient is copied); the run's gradients, buffers and random number "
            "generators are put back as they were."
        ),
        evidence=(
            TORCH_CHECKPOINT_DOCS,
            "measured: benchmarks/parity_memory.py (134M-parameter Llama, full fine-tune, reentrant, CPU)",
            "measured: benchmarks/callback_overhead.py parity_probe_benchmark_model (CPU, 2 threads)",
        ),
        remove_when="never: a check of the outcome",
    ),
    Rule(
        id="memory-plan",
        title="the cheapest checkpointing that fits the memory budget",
        kind="plan",
        setting="checkpointing_plan",
        condition=(
            "a memory budget is given (`SafeGCCallback(memory_budget=...)`, `install(memory_budget=...)`, "
            "`TRL_GC_PLUGIN_BUDGET`): the activation memory of every allowed candidate (no checkpointing, every n-th "
            "block, every block, selective per-op saving, offloading) is predicted from the bytes autograd saves in "
            "one forward of the model's layout, and the fastest one that fits is applied to the live model"
        ),
        message=(
            "Checkpointing every block costs a recompute of every block; when part of that memory would fit, "
            "checkpointing fewer blocks (or keeping the matmul outputs) is faster and gives the same gradients "
            "(non-reentrant checkpointing recomputes exactly). Only candidates the other rules allow are considered "
            "(selective needs non-reentrant, offloading an accelerator and transformers >= 5.23). A budget nothing "
            "fits is refused in strict mode; fix mode takes the lowest-memory plan with a warning. Under torch.compile "
            "the plan is made before the first forward from the arguments' batch shape (max_length, "
            "per_device_train_batch_size), and either its layout is compiled with the model or checkpointing is turned "
            "off and torch's activation_memory_budget is set (AOTAutograd's min-cut partitioner recomputes op by op; "
            "set back at the run's end), whichever benchmarks/vs_compile.py measured faster at that budget on the CPU."
        ),
        evidence=(
            "https://arxiv.org/abs/2205.05198 (Korthikanti et al. 2022, Reducing Activation Recomputation in Large "
            "Transformer Models)",
            "https://github.com/huggingface/transformers/blob/v5.23.0/src/transformers/modeling_utils.py "
            "(activation_checkpointing_enable: every_n_layers, offload)",
            "https://docs.pytorch.org/docs/stable/checkpoint.html (create_selective_checkpoint_contexts)",
        ),
        remove_when="transformers or torch plans checkpointing against a memory budget itself",
        level="info",
    ),
    Rule(
        id="batch-advice",
        title="the micro-batch and accumulation predicted fastest at the same effective batch",
        kind="plan",
        setting="per_device_train_batch_size",
        condition=(
            "a memory plan was made (`memory-plan`) and the arguments give `per_device_train_batch_size` and "
            "`gradient_accumulation_steps`: every micro-batch that divides the effective batch per device is planned "
            "under the same budget (the plan's estimate scaled to its rows, no new forward) and ranked by predicted "
            "tokens per second (`throughput.rank`)"
        ),
        message=(
            "Whether a larger micro-batch with more checkpointing or a smaller one with less (and more accumulation) "
            "trains faster depends on the model and the device. The plugin records the ranking and names the fastest; "
            "it never changes the batch: set `per_device_train_batch_size` and `gradient_accumulation_steps` to take "
            "the advice."
        ),
        evidence=(
            "benchmarks/throughput.py (the pick was the fastest of six measured micro-batch x plan pairs in three "
            "runs on CPU)",
            "https://github.com/huggingface/transformers/issues/29648",
        ),
        remove_when="the Trainer or accelerate chooses the micro-batch against a memory budget itself",
        level="info",
    ),
)


def get_rule(rule_id: str) -> Rule:
    """The rule with this id (KeyError if none)."""
    for rule in RULES:
        if rule.id == rule_id:
            return rule
    raise KeyError(rule_id)
