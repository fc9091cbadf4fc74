"""The decision engine on hand-made facts: no model, no trainer."""

from __future__ import annotations

import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet

from trl_gc_plugin import RULES, Facts, Rule, decide
from trl_gc_plugin.core.engine import applicable, coerce_bool, errors

TF4 = {"transformers": "4.57.6", "torch": "2.13.0"}
TF5 = {"transformers": "5.23.0", "torch": "2.13.0"}
FROZEN = dict(trainable_in_blocks=True, inputs_require_grad=False, frozen_params=True)


def facts(**kw) -> Facts:
    kw.setdefault("versions", TF4)
    kw.setdefault("gc_enabled", True)
    return Facts(**kw)


def by_setting(decisions, setting="use_reentrant"):
    found = [d for d in decisions if d.setting == setting]
    assert len(found) == 1, decisions
    return found[0]


def test_checkpointing_off_decides_nothing():
    (d,) = decide(Facts(gc_enabled=False))
    assert d.action == "none" and d.rule_id == "checkpointing-off" and not d.applied


@pytest.mark.parametrize("versions", [TF4, TF5])
def test_unset_gets_non_reentrant_default(versions):
    d = by_setting(decide(facts(versions=versions)))
    assert (d.rule_id, d.action, d.before, d.after, d.source, d.applied) == (
        "non-reentrant-default", "default", None, False, "unset", True)


def test_user_reentrant_on_a_full_model_is_kept_with_a_warning():
    d = by_setting(decide(facts(use_reentrant=True, use_reentrant_source="user", trainable_in_blocks=True,
                                inputs_require_grad=True)))
    assert (d.action, d.after, d.applied) == ("warn", True, False)


@pytest.mark.parametrize(("mode", "action", "after", "applied"), [
    ("strict", "error", False, False),
    ("fix", "override", False, True),
    ("warn", "warn", False, False),
])
def test_user_reentrant_with_frozen_inputs(mode, action, after, applied):
    ds = decide(facts(use_reentrant=True, use_reentrant_source="user", **FROZEN), mode)
    d = by_setting(ds)
    assert (d.rule_id, d.action, d.after, d.applied) == ("frozen-inputs-need-non-reentrant", action, after, applied)
    assert (errors(ds) != []) == (mode == "strict")


@pytest.mark.parametrize("source", ["unknown", "user"])
def test_explicit_values_of_unknown_origin_are_never_silently_overridden(source):
    d = by_setting(decide(facts(use_reentrant=True, use_reentrant_source=source, **FROZEN)))
    assert d.action == "error"


def test_a_value_the_plugin_wrote_earlier_is_replaced_by_a_requirement():
    d = by_setting(decide(facts(use_reentrant=True, use_reentrant_source="plugin", **FROZEN)))
    assert (d.action, d.after, d.applied) == ("default", False, True)


def test_a_trainer_value_is_overridden_by_a_requirement_and_kept_against_a_preference():
    d = by_setting(decide(facts(use_reentrant=True, use_reentrant_source="trainer", **FROZEN)))
    assert (d.action, d.after) == ("override", False)
    d = by_setting(decide(facts(use_reentrant=True, use_reentrant_source="trainer", trainable_in_blocks=True,
                                inputs_require_grad=True)))
    assert (d.action, d.after) == ("warn", True)


def test_frozen_inputs_without_trainable_block_params_need_nothing():
    d = by_setting(decide(facts(use_reentrant=True, use_reentrant_source="user", trainable_in_blocks=False,
                                inputs_require_grad=False)))
    assert d.rule_id == "non-reentrant-default" and d.action == "warn"


@pytest.mark.parametrize(("raw", "coerced"), [("false", False), ("False", False), ("0", False), ("true", True),
                                              ("yes", True), (0, False), (1, True)])
def test_string_use_reentrant_is_coerced(raw, coerced):
    ds = decide(facts(use_reentrant=raw, use_reentrant_source="user"))
    assert ds[0].rule_id == "invalid-use-reentrant" and ds[0].action == "repair" and ds[0].after is coerced
    assert ds.in_force == (coerced, "user") and ds.in_force[0] is coerced  # decide says the value it leaves in force


@pytest.mark.parametrize(("mode", "action"), [("strict", "error"), ("fix", "override"), ("warn", "warn")])
def test_unreadable_use_reentrant(mode, action):
    ds = decide(facts(use_reentrant="maybe", use_reentrant_source="user"), mode)
    assert ds[0].rule_id == "invalid-use-reentrant" and ds[0].action == action
    if mode == "fix":  # treated as unset afterwards
        assert by_setting(ds[1:]).action == "default"


def test_coerce_bool():
    assert coerce_bool("off") is False and coerce_bool(" TRUE ") is True
    assert coerce_bool("2") is None and coerce_bool(2) is None and coerce_bool(None) is None


def test_field_disagreement_last_write_wins_legacy_by_default():
    f = facts(versions=TF5, has_activation_fields=True, fields_disagree=True, use_reentrant=None,
              legacy_kwargs={"use_reentrant": True}, trainable_in_blocks=True, inputs_require_grad=True)
    ds = decide(f)
    assert ds[0].rule_id == "field-disagreement" and ds[0].setting == "activation_checkpointing_kwargs"
    assert ds[0].after is True and ds[0].action == "repair"
    assert by_setting(ds).action == "warn"  # the reconciled True has an unknown author: kept
    assert ds.in_force == (True, "unknown")


def test_field_disagreement_new_name_written_last():
    f = facts(versions=TF5, has_activation_fields=True, fields_disagree=True, use_reentrant=False,
              use_reentrant_source="user", legacy_kwargs=None, changed_field="new")
    ds = decide(f)
    assert ds[0].setting == "gradient_checkpointing_kwargs" and ds[0].action == "repair"


def test_field_disagreement_only_on_transformers_with_both_fields():
    f = facts(versions=TF4, has_activation_fields=True, fields_disagree=True, legacy_kwargs={"use_reentrant": True})
    assert all(d.rule_id != "field-disagreement" for d in decide(f))


def test_bool_flag_disagreement():
    f = facts(versions=TF5, has_activation_fields=True, fields_disagree=True, legacy_gc=False)
    assert any(d.setting == "activation_checkpointing" and d.after is False for d in decide(f))


def test_stale_model_kwargs_are_repaired():
    ds = decide(facts(model_gc_enabled=True, model_use_reentrant=True, stage="init_end"))
    stale = by_setting(ds, "model.use_reentrant")
    assert (stale.before, stale.after, stale.action) == (True, False, "repair")
    assert not [d for d in decide(facts(model_gc_enabled=True, model_use_reentrant=False)) if d.setting ==
                "model.use_reentrant"]


def test_warn_mode_applies_nothing():
    ds = decide(facts(model_gc_enabled=True, model_use_reentrant=True, use_cache=True, use_reentrant="false",
                      use_reentrant_source="user"), "warn")
    assert ds and not any(d.applied for d in ds)
    assert {d.action for d in ds} <= {"warn", "none"}


def test_use_cache_off_except_for_generating_trainers():
    assert by_setting(decide(facts(use_cache=True)), "model.config.use_cache").after is False
    assert not [d for d in decide(facts(use_cache=True, generates=True)) if d.setting == "model.config.use_cache"]
    assert not [d for d in decide(facts(use_cache=True, stage="post_init")) if d.setting == "model.config.use_cache"]


def test_quantized_model_prefers_non_reentrant():
    d = by_setting(decide(facts(quantization="bitsandbytes_4bit", use_reentrant=True, use_reentrant_source="user",
                                trainable_in_blocks=True, inputs_require_grad=True)))
    assert d.rule_id == "quantized-prefers-non-reentrant" and d.action == "warn"


def test_opposite_requirements_are_one_error_in_every_mode():
    always = dict(when=lambda f: f.gc_enabled, condition="always", message="m", evidence=("e",))
    rules = (Rule(id="a", title="a", kind="require", setting="use_reentrant", value=True, **always),
             Rule(id="b", title="b", kind="require", setting="use_reentrant", value=False, **always))
    for mode in ("strict", "fix", "warn"):
        (d,) = decide(facts(), mode, rules=rules)
        assert d.rule_id == "conflict" and d.action == "error" and "a (use_reentrant=True)" in d.reason


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        decide(facts(), "lenient")  # type: ignore[arg-type]


def test_stages():
    f = facts(stage="post_init", **FROZEN)
    assert "frozen-inputs-need-non-reentrant" not in {r.id for r in applicable(f)}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_every_rule_is_documented(rule):
    assert rule.id and rule.title and rule.condition and rule.message and rule.remove_when
    assert rule.kind in ("require", "prefer", "repair", "check", "verify", "plan", "state")
    assert rule.evidence and any(e.startswith("https://") for e in rule.evidence)
    for spec in rule.versions.values():
        SpecifierSet(spec)  # parses
    assert set(rule.stages) <= {"post_init", "init_end", "train", "runtime"} and rule.stages
    assert (rule.kind in ("verify", "plan")) == (rule.stages == ("runtime",))
    assert rule.to_dict()["id"] == rule.id


def test_the_engines_own_answers_are_rows_of_the_table():
    """`checkpointing-off` and `conflict` are decisions like any other: `get_rule` finds them and the docs list them."""
    from trl_gc_plugin.core.rules import get_rule

    (off,) = [d for d in decide(Facts(gc_enabled=False)) if d.rule_id == "checkpointing-off"]
    assert get_rule(off.rule_id).kind == "state" and off.evidence == get_rule("checkpointing-off").evidence
    assert get_rule("conflict").kind == "state"


def test_rule_ids_are_unique():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))


def test_engine_and_facts_import_no_transformers_or_torch():
    code = ("import sys, trl_gc_plugin, trl_gc_plugin.core.engine, trl_gc_plugin.core.facts, trl_gc_plugin.core.rules;"
            "trl_gc_plugin.decide(trl_gc_plugin.Facts(gc_enabled=True));"
            "print(sorted(m for m in ('torch', 'transformers', 'trl', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- distributed and heavy setups -------------------------------------------------------------------------------

DDP = dict(world_size=2, stage="init_end")


@pytest.mark.parametrize(("extra", "applies"), [
    (dict(ddp_find_unused_parameters=True, model_is_pretrained=True), True),
    (dict(ddp_find_unused_parameters=None, model_is_pretrained=False), True),  # a PeftModel
    (dict(ddp_find_unused_parameters=None, model_is_pretrained=True), False),
    (dict(ddp_find_unused_parameters=False, model_is_pretrained=False), False),
    (dict(ddp_find_unused_parameters=True, ddp_static_graph=True), False),
    (dict(ddp_find_unused_parameters=True, zero_stage=2), False),  # DeepSpeed, not DDP
    (dict(ddp_find_unused_parameters=True, fsdp=True), False),
])
def test_ddp_find_unused_rule(extra, applies):
    f = facts(use_reentrant=True, use_reentrant_source="user", trainable_in_blocks=True, inputs_require_grad=True,
              **DDP, **extra)
    d = by_setting(decide(f))
    assert (d.rule_id == "ddp-reentrant-find-unused" and d.action == "error") is applies
    single = f.replace(world_size=1)
    assert by_setting(decide(single)).rule_id != "ddp-reentrant-find-unused"


def test_ddp_rule_at_construction_with_an_explicit_find_unused():
    f = facts(stage="post_init", world_size=2, ddp_find_unused_parameters=True, use_reentrant=True,
              use_reentrant_source="user")
    assert errors(decide(f))[0].rule_id == "ddp-reentrant-find-unused"


ZERO3_PEFT = dict(zero_stage=3, frozen_params=True, is_peft=True, trainable_in_blocks=True, inputs_require_grad=True,
                  stage="init_end")


@pytest.mark.parametrize(("deepspeed", "required"), [("0.19.2", True), ("0.19.3", None), ("0.19.8", None)])
def test_zero3_frozen_rule_is_gated_on_the_deepspeed_release(deepspeed, required):
    versions = {**TF5, "deepspeed": deepspeed}
    d = by_setting(decide(facts(versions=versions, **ZERO3_PEFT)))
    if required:
        assert (d.rule_id, d.action, d.after) == ("zero3-frozen-needs-reentrant", "default", True)
        d = by_setting(decide(facts(versions=versions, use_reentrant=False, use_reentrant_source="user", **ZERO3_PEFT)))
        assert d.action == "error" and "deepspeed>=0.19.3" in d.reason
    else:
        assert (d.rule_id, d.after) == ("non-reentrant-default", False)


def test_old_deepspeed_zero3_and_multi_gpu_rl_qlora_conflict_is_one_error_naming_the_way_out():
    f = facts(versions={**TF5, "deepspeed": "0.19.2"}, world_size=2, rl_trainer=True, quantization="bitsandbytes_4bit",
              **ZERO3_PEFT)
    for mode in ("strict", "fix", "warn"):
        (err,) = errors(decide(f, mode))
        assert err.rule_id == "conflict"
        assert "zero3-frozen-needs-reentrant" in err.reason and "distributed-rl-qlora-no-reentrant" in err.reason
        assert "Upgrade to deepspeed>=0.19.3" in err.reason


def test_distributed_rl_qlora_refuses_reentrant():
    f = facts(world_size=2, rl_trainer=True, is_peft=True, quantization="bitsandbytes_4bit", use_reentrant=True,
              use_reentrant_source="user", trainable_in_blocks=True, inputs_require_grad=True, stage="init_end")
    assert errors(decide(f))[0].rule_id == "distributed-rl-qlora-no-reentrant"
    assert not errors(decide(f.replace(world_size=1)))
    assert not errors(decide(f.replace(rl_trainer=False)))


@pytest.mark.parametrize(("source", "mode", "action"), [
    ("user", "strict", "error"), ("user", "fix", "override"), ("user", "warn", "warn"),
    ("trainer", "strict", "override"),  # TRL's configs switch checkpointing on by default
])
def test_fsdp_activation_checkpointing_conflict(source, mode, action):
    f = facts(fsdp=True, fsdp_activation_checkpointing=True, gc_flag_source=source, stage="post_init")
    d = by_setting(decide(f, mode), "activation_checkpointing")
    assert (d.rule_id, d.action, d.after) == ("fsdp-activation-checkpointing", action, False)


def test_unsloth_stands_back():
    (d,) = decide(facts(unsloth=True, use_reentrant=True, use_reentrant_source="user", **FROZEN))
    assert d.rule_id == "unsloth-owns-checkpointing" and d.action == "warn" and not d.applied


# --- rules v2 on plain facts (the real reproductions are in test_rules_v2.py) -----------------------------------


def test_use_cache_goes_off_under_fsdps_own_checkpointing_too():
    """FSDP's activation checkpointing with the Trainer's off: reproduced on 4.57 (checkpoint_wrapper + use_cache ->
    CheckpointError); the engine must not stop at "checkpointing off"."""
    f = facts(gc_enabled=False, fsdp=True, fsdp_activation_checkpointing=True, world_size=2, use_cache=True)
    d = by_setting(decide(f), "model.config.use_cache")
    assert (d.rule_id, d.action, d.after) == ("use-cache-off", "default", False)
    assert decide(f.replace(fsdp_activation_checkpointing=False))[0].rule_id == "checkpointing-off"


def test_non_reentrant_only_options_against_old_deepspeed_zero3_are_one_conflict():
    f = facts(versions={**TF5, "deepspeed": "0.19.2"}, kwargs_keys=("context_fn",), **ZERO3_PEFT)
    for mode in ("strict", "fix", "warn"):
        (err,) = errors(decide(f, mode))
        assert err.rule_id == "conflict"
        assert "zero3-frozen-needs-reentrant" in err.reason and "non-reentrant-only-kwargs" in err.reason


@pytest.mark.parametrize(("versions", "rule"), [(TF4, "layer-kwargs-unsupported"), (TF5, None)])
def test_layer_kwargs_before_5_16_are_taken_out(versions, rule):
    ds = decide(facts(versions=versions, kwargs_keys=("every_n_layers",), every_n_layers=2))
    found = [d for d in ds if d.setting == "checkpointing_kwargs"]
    assert [d.rule_id for d in found] == ([rule] if rule else [])
    if rule:
        assert found[0].action == "repair" and found[0].before == ("every_n_layers",) and found[0].applied


@pytest.mark.parametrize(("accelerator", "refused"), [(False, True), (True, False), (None, False)])
def test_offload_needs_an_accelerator(accelerator, refused):
    """transformers' offload needs torch built with an accelerator backend (pin_memory), not a device."""
    f = facts(versions=TF5, offload=True, kwargs_keys=("offload",), accelerator_built=accelerator, accelerator=False)
    assert bool([d for d in errors(decide(f)) if d.rule_id == "offload-needs-accelerator"]) is refused


def test_preserve_rng_state_only_matters_with_dropout():
    f = facts(preserve_rng_state=False, kwargs_keys=("preserve_rng_state",), dropout=True)
    assert errors(decide(f))[0].rule_id == "preserve-rng-state-with-dropout"
    assert by_setting(decide(f, "fix"), "preserve_rng_state").after is True
    assert not errors(decide(f.replace(dropout=False)))
    assert not errors(decide(f.replace(preserve_rng_state=None)))  # torch's default is True


def test_every_rule_setting_has_a_value_the_engine_can_read_and_a_way_to_be_written():
    """Each setting a rule acts on (other than use_reentrant and the runtime's own) maps to a fact, and each setting a
    rule can change has a writer (`model.write.WRITERS`): a new rule the engine cannot read or the run cannot carry out
    fails here, not in a user's run."""
    from trl_gc_plugin.core.rules import RULES
    from trl_gc_plugin.core.targets import TARGETS, current
    from trl_gc_plugin.model import write

    for target in TARGETS.values():
        if target.read is not None:
            target.read(Facts(gc_enabled=True))  # a fact that exists
    for rule in RULES:
        if rule.kind in ("require", "prefer", "repair", "check") and rule.setting not in (
                "use_reentrant", "model.use_reentrant", "activation_checkpointing_kwargs"):
            _, source = current(Facts(gc_enabled=True), rule.setting, "fallback", "fallback")
            assert source != "fallback" or rule.kind == "check", rule.id
        if rule.kind in ("require", "prefer", "repair") and rule.setting != "model.config.use_cache":
            assert rule.setting in write.WRITERS, rule.id  # the callback switches use_cache step by step
    assert set(write.WRITERS) | set(write.UNDO) <= set(TARGETS)
    assert write.apply([], None) == []


def test_fp8_training_with_checkpointing_is_said():
    from trl_gc_plugin import Facts, decide

    said = [d for d in decide(Facts(gc_enabled=True, fp8="torchao.float8.Float8Linear")) if d.rule_id == "fp8-checkpointing"]
    assert [(d.action, d.level) for d in said] == [("warn", "warning")]
    assert said[0].reason.startswith("The model trains in FP8 (torchao.float8.Float8Linear)")
    assert not [d for d in decide(Facts(gc_enabled=True)) if d.rule_id == "fp8-checkpointing"]


def test_moe_explicit_reentrant_is_overridden_in_fix_and_kept_in_strict():
    from trl_gc_plugin import Facts, decide

    facts = Facts(gc_enabled=True, moe_routers=2, use_reentrant=True, use_reentrant_source="user")
    got = {m: [(d.action, d.after) for d in decide(facts, m) if d.rule_id == "moe-routing-recomputed"]
           for m in ("strict", "fix", "warn")}
    assert got == {"strict": [("warn", True)], "fix": [("override", False)], "warn": [("warn", True)]}


def test_every_fact_says_what_it_means():
    """`Facts` is the engine's only input: each field is named, with its meaning, in the class docstring (issue 45:
    the size pass had cut 29 of them), so a new field cannot land without one."""
    import dataclasses

    lines = Facts.__doc__.splitlines()
    for field in dataclasses.fields(Facts):
        said = [line for line in lines if line.lstrip().startswith("- ") and f"`{field.name}`" in line]
        assert said and len(said[0].split(":", 1)[-1].strip()) > 10, f"Facts.{field.name} has no meaning in the docstring"
