"""The decision engine: `decide(facts, mode) -> list[Decision]`.

Pure: plain `Facts` in, `Decision` records out; no transformers import, no I/O, no mutation. Precedence:

1. `repair` rules that restore a readable value (field disagreement, then a non-bool `use_reentrant`).
2. `require` rules for `use_reentrant`; two that demand opposite values are one `error` (in every mode).
3. otherwise the first `prefer` rule in table order (table order is priority).
4. the chosen value meets what is set: unset -> `default`; equal -> `none`; set by the user (or unknown) and a
   `require` -> `error` (strict) / `override` (fix) / `warn` (warn); set by the user and a `prefer` -> `warn`,
   kept; set by the trainer or the plugin -> replaced for a `require` (`override`), kept with a warning for a
   `prefer` when a trainer wrote it, replaced when the plugin wrote it earlier (`default`).
5. repairs of the live model, then settings other than `use_reentrant`, then `check` warnings.

A plugin default never overrides a value the user set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .._base.flags import parse_flag as coerce_bool
from . import targets
from .capabilities import Capabilities
from .decisions import Action, Decision, Decisions, Level
from .facts import Facts
from .modes import MODES, Mode
from .policy import refused
from .rules import RULES, USE_REENTRANT, Rule, get_rule

_EXPLICIT = {"user", "unknown"}
_OFF_REASON = "Checkpointing is off: nothing to decide."
_VERB = {"error": "is refused", "override": "is OVERRIDDEN", "warn": "breaks training"}
_VERB_DETAIL = {"error": "Refused.", "override": "OVERRIDDEN.", "warn": "This breaks training."}


def capabilities_apply(rule: Rule, caps: Capabilities) -> bool:
    """Whether the stack can do what `rule.needs` says (an unknown capability, `None`, fails the gate)."""
    return all(getattr(caps, name) is want for name, want in rule.needs.items())


def applicable(facts: Facts, rules: Sequence[Rule] = RULES) -> list[Rule]:
    """The rules whose stage, capability gates and condition hold for `facts`, in table order."""
    caps = facts.caps
    return [r for r in rules if facts.stage in r.stages and capabilities_apply(r, caps) and r.when(facts)]


def _detail(rule: Rule, facts: Facts) -> str:
    """The rule's fact-specific first sentence, with a trailing blank ('' without one)."""
    return rule.detail(facts) + " " if rule.detail is not None else ""


def _refuse_explicit(rule: Rule, mode: Mode, current: Any, source: str, facts: Facts) -> Decision:
    """An explicit value that a `require` rule says breaks training: error (strict), override (fix), warn."""
    action = refused(mode)
    if rule.detail is not None:
        reason = _detail(rule, facts) + _VERB_DETAIL[action] + " " + rule.message
    else:
        reason = f"{rule.setting}={current!r} {_VERB[action]}: {rule.condition}. " + rule.message
    return rule.decision(action, current, rule.value, source, reason, facts.stage)


def decide(facts: Facts, mode: Mode = "strict", rules: Sequence[Rule] = RULES) -> Decisions:
    """The decisions for one training setup, in the order they are to be applied. `error` decisions are never
    applied; the caller raises `GCConfigError` for them in strict and fix mode.

    Example:
        >>> from trl_gc_plugin import Facts, decide
        >>> [d.after for d in decide(Facts(gc_enabled=True)) if d.setting == "use_reentrant"]
        [False]
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    return Decisions(_decide(facts, mode, rules))


def _decide(facts: Facts, mode: Mode, rules: Sequence[Rule]) -> list[Decision]:
    if not facts.gc_enabled and not facts.fsdp_activation_checkpointing:
        off = get_rule("checkpointing-off").decision(
            "none", False, False, facts.gc_flag_source, _OFF_REASON, facts.stage
        )
        checks = [r for r in applicable(facts, rules) if r.kind == "check"]  # said whether checkpointing is on or off
        return [off] + [r.decision("warn", None, None, "unset", r.message, facts.stage, level=r.level) for r in checks]

    rules_here = applicable(facts, rules)
    standing_back = next((r for r in rules_here if r.stand_back), None)
    if standing_back is not None:  # another library owns checkpointing: say so and decide nothing
        value, source, r = facts.use_reentrant, facts.use_reentrant_source, standing_back
        return [r.decision("warn", value, value, source, r.message, facts.stage, level=r.level)]
    by_kind = {kind: [r for r in rules_here if r.kind == kind] for kind in ("require", "prefer", "repair", "check")}
    repairs = {r.id: r for r in by_kind["repair"]}
    out: list[Decision] = []
    value, source = facts.use_reentrant, facts.use_reentrant_source
    if "field-disagreement" in repairs:  # 1a. the two field names disagree: the one written last wins
        value, source = _field_disagreement(repairs["field-disagreement"], facts, value, source, out)
    if value is not None and not isinstance(value, bool):  # 1b. a non-bool use_reentrant
        value, source = _non_bool(repairs.get("invalid-use-reentrant"), facts, mode, value, source, out)
    final = _choose_use_reentrant(by_kind, facts, mode, value, source, out)  # 2./3. the value
    _stale_model(repairs.get("model-kwargs-stale"), facts, final, out)  # 4. the live model
    _other_settings(by_kind, facts, mode, value, source, out)  # 5. other settings, then checks
    if mode != "warn":
        return out
    # in warn mode every change becomes a `warn` (logged, not applied), at the level the change would have had
    changes = ("default", "override", "repair")
    return [dataclasses.replace(d, action="warn", applied=False) if d.action in changes else d for d in out]


def _field_disagreement(rule: Rule, facts: Facts, value: Any, source: str, out: list[Decision]) -> tuple[Any, str]:
    """The two field names hold different values: the one written after `__post_init__` wins (the deprecated one when
    unknown); returns the `use_reentrant` that then stands and its source."""

    def repair(before: Any, after: Any, who: str, setting: str, reason: str) -> None:
        out.append(rule.decision("repair", before, after, who, reason, facts.stage, setting=setting))

    if facts.changed_field != "new":
        if facts.legacy_gc is not None:
            why = "`gradient_checkpointing` was written after `__post_init__`; copied to `activation_checkpointing`."
            repair(not facts.legacy_gc, facts.legacy_gc, "unknown", "activation_checkpointing", why)
        legacy = facts.legacy_kwargs
        legacy_value = legacy.get(USE_REENTRANT) if isinstance(legacy, dict) else None
        if legacy_value != value or legacy is None:
            why = (
                "`gradient_checkpointing_kwargs` was written after `__post_init__` and the Trainer would ignore it "
                f"(it reads `activation_checkpointing_kwargs`, use_reentrant={facts.use_reentrant!r}); "
                "the last write wins and both names now hold one dict."
            )
            repair(facts.use_reentrant, legacy_value, "unknown", "activation_checkpointing_kwargs", why)
            value, source = legacy_value, "unknown"
    else:
        why = (
            "`activation_checkpointing*` was written after `__post_init__`; the deprecated "
            "`gradient_checkpointing*` names are made to mirror it."
        )
        repair(None, None, source, "gradient_checkpointing_kwargs", why)
    return value, source


def _non_bool(
    rule: Rule | None, facts: Facts, mode: Mode, value: Any, source: str, out: list[Decision]
) -> tuple[Any, str]:
    """A `use_reentrant` that is not a bool: converted when it spells one, refused (or dropped) when not."""
    rule = rule or get_rule("invalid-use-reentrant")
    coerced = coerce_bool(value)
    if coerced is not None:
        why = (
            f"use_reentrant={value!r} is not a bool (torch would read it as {bool(value)!r}); converted to {coerced!r}."
        )
        out.append(rule.decision("repair", value, coerced, source, why, facts.stage))
        value = coerced
    else:
        why = f"use_reentrant={value!r} is not a bool and spells none; " + rule.message
        out.append(rule.decision(refused(mode), value, None, source, why, facts.stage))
        value, source = None, "unset"
    return value, source


def _choose_use_reentrant(
    by_kind: dict[str, list[Rule]], facts: Facts, mode: Mode, value: Any, source: str, out: list[Decision]
) -> Any:
    """The value for `use_reentrant` from the `require` and `prefer` rules on it: a default for an unset value, an
    override of the plugin's or the Trainer's, a refusal of an explicit one a `require` rule knows breaks training;
    returns the value in force after them."""
    requires = [r for r in by_kind["require"] if r.setting == USE_REENTRANT]
    prefers = [r for r in by_kind["prefer"] if r.setting == USE_REENTRANT]
    demanded = {r.value for r in requires}
    final: Any = value
    if len(demanded) > 1:
        names = ", ".join(f"{r.id} (use_reentrant={r.value})" for r in requires)
        reason = f"Rules demand opposite values: {names}. " + " ".join(r.message for r in requires)
        conflict = get_rule("conflict").decision("error", value, None, source, reason, facts.stage)
        out.append(dataclasses.replace(conflict, evidence=tuple(e for r in requires for e in r.evidence)))
    elif requires or prefers:
        rule = requires[0] if requires else prefers[0]
        strong, target = bool(requires), rule.value

        def say(action: Action, before: Any, after: Any, who: str, reason: str, level: Level | None = None) -> None:
            out.append(rule.decision(action, before, after, who, reason, facts.stage, level=level))

        if value is None:
            say("default", None, target, "unset", f"use_reentrant unset; set to {target!r} ({rule.title}).")
            final = target
        elif value == target:
            say("none", value, value, source, f"use_reentrant={value!r} kept ({rule.title}).")
        elif source == "plugin" or (strong and source == "trainer"):
            reason = f"use_reentrant={value!r} (set by the {source}) replaced by {target!r} ({rule.title}). "
            action: Action = "default" if source == "plugin" else "override"
            say(action, value, target, source, reason + (rule.message if strong else ""))
            final = target
        elif strong:
            refusal = _refuse_explicit(rule, mode, value, source, facts)
            out.append(refusal)
            if refusal.action == "override":
                final = target
        elif rule.fix_overrides and mode == "fix":
            reason = f"use_reentrant={value!r} (set by {source}) is OVERRIDDEN to {target!r} ({rule.title}). "
            say("override", value, target, source, reason + rule.message)
            final = target
        elif rule.fix_overrides:
            reason = f"use_reentrant={value!r} kept as set ({rule.title}). " + rule.message
            say("warn", value, value, source, reason)
        else:
            reason = f"use_reentrant={value!r} kept as set; {target!r} is preferred. " + rule.message
            say("warn", value, value, source, reason, level="info")
    return final


def _stale_model(rule: Rule | None, facts: Facts, final: Any, out: list[Decision]) -> None:
    """The model already checkpoints with another `use_reentrant` than the one in force: rewrite it."""
    effective = final if isinstance(final, bool) else None
    running = facts.model_use_reentrant
    if rule is not None and effective is not None and running != effective:
        reason = f"The model already checkpoints with use_reentrant={running!r}; rewritten to {effective!r}. "
        out.append(rule.decision("repair", running, effective, "trainer", reason + rule.message, facts.stage))


def _other_settings(
    by_kind: dict[str, list[Rule]], facts: Facts, mode: Mode, value: Any, source: str, out: list[Decision]
) -> None:
    """The `require` / `prefer` rules on settings other than `use_reentrant`, the repairs not folded into its choice,
    then the `check` rules."""
    for rule in by_kind["require"] + by_kind["prefer"]:
        if rule.setting == USE_REENTRANT:
            continue
        current, who = targets.current(facts, rule.setting)
        if current == rule.value:
            continue
        if rule.kind == "prefer" or who not in _EXPLICIT:
            action: Action = "override" if rule.kind == "require" and who == "trainer" else "default"
            reason = f"{rule.title}." + (" " + rule.message if rule.kind == "require" else "")
            out.append(rule.decision(action, current, rule.value, who, reason, facts.stage))
        else:
            out.append(_refuse_explicit(rule, mode, current, who, facts))
    # repairs of a setting other than use_reentrant (those above are repaired on the way to the value)
    for rule in by_kind["repair"]:
        if rule.setting in _REPAIRED_ABOVE:
            continue
        current, who = targets.current(facts, rule.setting)
        out.append(rule.decision("repair", current, rule.value, who, rule.message, facts.stage))
    for rule in by_kind["check"]:
        current, who = targets.current(facts, rule.setting, value, source)
        reason = _detail(rule, facts) + rule.message
        said: Action = "none" if rule.level == "info" else "warn"  # an info check is a note, not a warning
        out.append(rule.decision(said, current, current, who, reason, facts.stage, level=rule.level))


_REPAIRED_ABOVE = frozenset({USE_REENTRANT, "activation_checkpointing_kwargs", "model.use_reentrant"})
"""Repairs `decide` folds into the choice of `use_reentrant` (field disagreement, a non-bool value, a stale model)."""


def errors(decisions: Sequence[Decision]) -> list[Decision]:
    """The `error` decisions."""
    return [d for d in decisions if d.action == "error"]
