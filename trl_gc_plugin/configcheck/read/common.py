"""The check's records (`Fact`, `Reading`, `LauncherRule`, `Context`) and typed access to config values with errors
that name the key. Standard library only: reading a config never imports torch or transformers."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..._base.report import short
from ...core.decisions import Action, Decision, Level
from ...core.errors import UsageError, type_name
from ...core.facts import GENERATING_TRAINERS, RL_TRAINERS

Origin = Literal[
    "file",
    "launcher default",
    "launcher rewrite",
    "accelerate config",
    "deepspeed config",
    "model config",
    "option",
    "installed",
    "assumed",
]
"""Where a fact comes from; `launcher rewrite` is a value the launcher writes itself (Axolotl's `normalize_config`,
TRL's trainers, LLaMA-Factory's model patching), `assumed` one the check assumes and says."""


def release(version: str | None) -> tuple[int, int]:
    """(major, minor) of a version string; a part that is not a number counts 0 (`5.10.0.dev0` -> (5, 10))."""
    major, minor, *_ = [int(p) if p.isdigit() else 0 for p in (version or "0").split(".")[:2]] + [0]
    return major, minor


ConfigError = UsageError
"""A config (or a file it names, or an option) is invalid: one line naming the file and key or line; exit 2 (the CLIs'
one `UsageError`, under the name the check uses)."""


class NotTrainingConfig(ConfigError):
    """No training config of a known launcher: skipped with `--skip-other-files` (a pre-commit hook)."""


def find_beside(
    name: str, base_dir: str, exists: Callable[[str], bool] = os.path.isfile, beside_first: bool = False
) -> str | None:
    """The first of `name` from the current directory (where launchers read it) and `name` next to the config in
    `base_dir` that `exists`; None for neither."""
    candidates = [name] if os.path.isabs(name) else [name, os.path.join(base_dir, name)]
    return next((c for c in (candidates[::-1] if beside_first else candidates) if exists(c)), None)


@dataclass(frozen=True)
class Config:
    """`values` of the top-level keys the check reads (every key for JSON), all `keys` in file order, the line of
    each (YAML only); `kind` is `yaml`, `json`, or `command` (an OpenRLHF command line's flags)."""

    path: str
    values: dict[str, Any]
    keys: tuple[str, ...]
    lines: dict[str, int] = field(default_factory=dict)
    kind: str = "yaml"

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    @property
    def base_dir(self) -> str:
        return os.path.dirname(os.path.abspath(self.path))


@dataclass(frozen=True)
class Fact:
    """One `Facts` field's value, where it came from, and the key, file or option behind it, in words."""

    value: Any
    origin: Origin
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "origin": self.origin, "detail": self.detail}


@dataclass(frozen=True, kw_only=True)
class LauncherRule:
    """A verdict of a launcher's own code about a config, as data: `id` is `<launcher>:<name>`; `action` `error`
    (it refuses to start), `warn` (it warns, or reads the file otherwise than it seems to say) or `none`; `when` a
    predicate on the launcher module's view; `change` the one change to make; `disagreement` why the plugin decides
    otherwise on purpose; `remove_when` when the rule can go."""

    id: str
    action: Action
    setting: str
    condition: str
    message: str
    evidence: tuple[str, ...]
    when: Callable[[Any], bool]
    change: str = ""
    disagreement: str = ""
    remove_when: str = ""

    def decision(self, version: str, before: Any = None, source: str = "user") -> Decision:
        """This rule's verdict, never applied; `before` is the value it is about, `source` who set it."""
        level: Level = "error" if self.action == "error" else "warning" if self.action == "warn" else "info"
        reason = f"{self.message} ({version})"
        if self.disagreement:
            reason += f" The plugin disagrees on purpose: {self.disagreement}"
        return Decision(
            rule_id=self.id,
            action=self.action,
            setting=self.setting,
            before=before,
            after=before,
            source=source,
            reason=reason,
            evidence=self.evidence,
            level=level,
        )


@dataclass
class Reentrant:
    """use_reentrant as each phase of a launcher leaves it (with the kwargs, where they are kept), and its facts'
    origin and detail."""

    value: Any
    origin: Origin
    detail: str
    kwargs: dict[str, Any] | None = None

    @property
    def source(self) -> str:
        """Who set it, in a decision's words: the file's value is the user's, the launcher's own is unknown."""
        return "user" if self.origin == "file" else "unknown"

    def rewrite(self, value: Any, detail: str, origin: Origin = "launcher rewrite") -> None:
        self.value, self.detail, self.origin = value, detail, origin


@dataclass(frozen=True)
class Context:
    """The check's options (None: not given) and the versions the rules are evaluated for, with where each comes
    from (`installed`, `option` or `assumed`)."""

    nproc: int | None = None
    trainer: str | None = None
    accelerate_config: str | None = None
    no_script_args: bool = False
    versions: Mapping[str, str | None] = field(default_factory=dict)
    version_origins: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Reading:
    """What one launcher module read from one config file. `parser` names the launcher's own code or the plugin's
    model of it. `changes` spell a setting in this format for the "change:" line, a `str.format` template (`{value}`
    in YAML spelling, `{not_value}` its negation; a command-line switch starts with `{switch}`: `add` or `remove`).
    `training` is False for a config that trains nothing; `changes_for` holds `LauncherRule.change` by rule id;
    `extra` what a module keeps between reading and finishing; `unread` what the verdict depends on but could not be
    read: the check then says `incomplete`, never `ok`."""

    format: str
    parser: str
    facts: dict[str, Fact] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    changes: dict[str, str] = field(default_factory=dict)
    training: bool = True
    changes_for: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)

    def set(self, name: str, value: Any, origin: Origin, detail: str = "") -> None:
        self.facts[name] = Fact(value, origin, detail)

    def set_key(self, key: str, value: Any, unset: str = "unset: transformers decides") -> None:
        """The fact of the file's key `key`, read as a bool (None with `unset` as detail when it is absent)."""
        if value is None:
            self.set(key, None, "launcher default", unset)
        else:
            self.set(key, bool(value), "file", f"key {key!r}")

    def set_model(
        self,
        peft: Fact,
        quant: Fact,
        frozen: Fact,
        blocks: str,
        grads: Fact,
        no_adapter: str = "no adapter",
    ) -> None:
        """The model facts of every format; `model_is_pretrained` follows from PEFT, `trainable_in_blocks` is assumed
        (`blocks` says why)."""
        pretrained = "a PEFT model is not a PreTrainedModel" if peft.value else no_adapter
        self.facts.update(is_peft=peft, quantization=quant, frozen_params=frozen)
        self.set("model_is_pretrained", not peft.value, "file", pretrained)
        self.set("trainable_in_blocks", True, "assumed", blocks)
        self.facts["inputs_require_grad"] = grads

    def set_trainer(
        self,
        kind: str,
        origin: Origin,
        detail: str,
        kind_origin: Origin | None = None,
        kind_detail: str = "",
        rl: bool | None = None,
        generates: bool | None = None,
    ) -> None:
        """`trainer_kind` and what follows from it (by TRL's trainer kinds unless `rl` / `generates` say)."""
        self.set("trainer_kind", kind, kind_origin or origin, kind_detail or detail)
        self.set("rl_trainer", kind in RL_TRAINERS if rl is None else rl, origin, detail)
        self.set("generates", kind in GENERATING_TRAINERS if generates is None else generates, origin, detail)

    def set_world_size(
        self, ctx: Context, assumed: str, *known: tuple[Any, Origin, str], option: str = "--nproc"
    ) -> int:
        """`--nproc`, else the first of the `known` counts that is not None, else 1 process (`assumed` says why)."""
        given = ((ctx.nproc, "option", option), *known)
        count, origin, detail = next((k for k in given if k[0] is not None), (1, "assumed", assumed))
        self.set("world_size", count, origin, detail)
        return int(count)

    def value(self, name: str, default: Any = None) -> Any:
        fact = self.facts.get(name)
        return default if fact is None else fact.value

    def apply(
        self,
        rules: tuple[LauncherRule, ...],
        view: Any,
        version: str,
        raw: Mapping[str, Any],
        befores: Mapping[str, Any] | None = None,
        sources: Mapping[str, str] | None = None,
    ) -> None:
        """The decisions of the `rules` that hold on `view`, each about `befores[setting]` (by default the current
        use_reentrant, else the file's value in `raw`) set by `sources[setting]` (by default the user)."""
        source = self.value("use_reentrant_source", "unset")
        source = f"launcher ({self.format})" if source == "unknown" else str(source)
        befores = {"use_reentrant": self.value("use_reentrant"), **(befores or {})}
        sources = {"use_reentrant": source, **(sources or {})}
        for rule in rules:
            if rule.when(view):
                before = befores.get(rule.setting, raw.get(rule.setting))
                self.decisions.append(rule.decision(version, before, sources.get(rule.setting, "user")))
                if rule.change:
                    self.changes_for[rule.id] = rule.change


# --- typed access ----------------------------------------------------------------------------------------------


def where(path: str, key: str, lines: Mapping[str, int] | None = None) -> str:
    """`path: key 'k' (line n)`: the prefix of every message about a key."""
    line = (lines or {}).get(key.split(".", 1)[0])
    return f"{path}: key {key!r}" + (f" (line {line})" if line else "")


def expect_mapping(
    value: Any, path: str, key: str, lines: Mapping[str, int] | None = None, example: str = ""
) -> dict[str, Any]:
    if not isinstance(value, dict):
        hint = f" such as {example}" if example else ""
        raise ConfigError(f"{where(path, key, lines)}: expected a mapping{hint}, got {type_name(value)} {short(value)}")
    for k in value:
        if not isinstance(k, str):
            raise ConfigError(f"{where(path, key, lines)}: keys must be strings, got {short(k)}")
    return value


def json_object_or_mapping(
    value: Any, path: str, key: str, lines: Mapping[str, int] | None = None, example: str = ""
) -> dict[str, Any]:
    """A mapping, or a JSON object written as a string (which `TrainingArguments` decodes itself)."""
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"{where(path, key, lines)}: not a JSON object: {exc}") from None
    return expect_mapping(value, path, key, lines, example)


KWARGS_CHANGES = {
    "use_reentrant": "gradient_checkpointing_kwargs: {{use_reentrant: {value}}}",
    "activation_checkpointing": "gradient_checkpointing: {value}",
}
"""`Reading.changes` of the YAML formats that take transformers' `gradient_checkpointing_kwargs` (copy it)."""

BOOL_WORDS = {
    **dict.fromkeys(("yes", "true", "t", "y", "1"), True),
    **dict.fromkeys(("no", "false", "f", "n", "0"), False),
}


def string_to_bool(text: str) -> bool | None:
    """A boolean option as `transformers.hf_argparser.string_to_bool` (TRL's `TrlParser`) reads it; None: refused."""
    return BOOL_WORDS.get(text.lower())


def yaml_bool(value: bool) -> str:
    return "true" if value else "false"
