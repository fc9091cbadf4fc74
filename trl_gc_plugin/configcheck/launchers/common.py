"""Shared pieces of the config check: where a fact came from, what one launcher's reading of a file gives, the
launchers' own verdicts as data, and typed access to config values with errors that name the key.

Standard library only (plus this package's records): reading a config never imports torch or transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ...core.decisions import Action, Decision, Level
from ...core.errors import short, type_name

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
"""Where a fact comes from: the config file itself; a default of the launcher (the key is absent); a value the
launcher writes itself (Axolotl's `normalize_config`, TRL's trainers, LLaMA-Factory's model patching); the
accelerate or DeepSpeed config the launch uses; the `config.json` of a local model directory the config names; a
command-line option of the check; the packages installed where the check runs; or an assumption the check makes and
says (an unknown version, an unknown process count)."""


def line_link(src: str, file: str, first: int, last: int, what: str) -> str:
    """A link to lines `first`-`last` of `file` under the source tree `src`, with what they show."""
    return f"{src}{file}#L{first}-L{last} ({what})"


def release(version: str | None) -> tuple[int, int]:
    """(major, minor) of a version string; a part that is not a number counts 0 (`5.10.0.dev0` -> (5, 10))."""
    major, minor, *_ = [int(p) if p.isdigit() else 0 for p in (version or "0").split(".")[:2]] + [0]
    return major, minor


class ConfigError(ValueError):
    """A config (or a file it names) cannot be read, or a check option is invalid. The message is one line that
    names the file and the key or line, and what to change; the CLI exits 2 with it."""


class NotTrainingConfig(ConfigError):
    """The file is no training config of a known launcher (an accelerate or DeepSpeed config, a shell script without
    an OpenRLHF command, a YAML file of no launcher): an error for a file given to check, skipped with
    `--skip-other-files` (a pre-commit hook over every YAML file of a repository)."""


@dataclass(frozen=True)
class Config:
    """A config file as the check sees it: `values` of the top-level keys the check reads (every key for JSON),
    every key in file order, the 1-based line of each (YAML only); `kind` is `yaml`, `json`, or `command` (an
    OpenRLHF command line's flags)."""

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
    """One fact read for the rule engine (a `Facts` field), where it came from, and the key, file, option or source
    location behind it, in words."""

    value: Any
    origin: Origin
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "origin": self.origin, "detail": self.detail}


@dataclass(frozen=True, kw_only=True)
class LauncherRule:
    """A verdict of a launcher's own code about a config, kept as data like the plugin's rules.

    `id` is `<launcher>:<name>` (`trl:`, `axolotl:`, `llamafactory:`, `training-args:`). `action` is `error` when the
    launcher refuses to start on the config, `warn` when it starts but warns or reads the config differently from
    what it seems to say, `none` for information (e.g. where the plugin disagrees with the launcher on purpose).
    `change` is the one change to make in the file ("" when nothing needs changing), `evidence` links to the
    launcher's source at the version modelled, `when` a predicate on the launcher module's view of the config, and
    `disagreement` why the plugin decides otherwise on purpose ("" when it agrees).
    """

    id: str
    action: Action
    setting: str
    condition: str = ""
    message: str
    evidence: tuple[str, ...]
    when: Callable[[Any], bool]
    change: str = ""
    disagreement: str = ""

    def decision(self, version: str, before: Any = None, source: str = "user") -> Decision:
        """This rule's verdict as a `Decision` (never applied: the check changes nothing). `before` is the value
        the rule is about and `source` who set it (`user` for the file, `launcher (...)` for a launcher's value);
        the rule id's prefix (`axolotl:`) says whose verdict it is."""
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
            applied=False,
            stage="init_end",
            level=level,
        )


@dataclass(frozen=True)
class Context:
    """What the check's options and the machine say beside the file (None: the option is not given; without
    `--nproc` the launcher module takes the file's or assumes 1). `versions` are those the rules are evaluated for,
    `version_origins` where each comes from: `installed`, `option` or `assumed`."""

    nproc: int | None = None
    trainer: str | None = None
    accelerate_config: str | None = None
    versions: Mapping[str, str | None] = field(default_factory=dict)
    version_origins: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Reading:
    """What one launcher module read from one config file.

    `parser` says who read it: the launcher's own code (`TRL 1.16.0 TrlParser (trl sft)`) or the plugin's model of
    it (`the plugin's model of Axolotl main@067b021c`). `notes` are what the reader wants said (ignored keys,
    assumptions, fallbacks), one line each. `changes` spell a setting in this format, for the "change:" line
    (`use_reentrant` -> `gradient_checkpointing_kwargs: {{use_reentrant: {value}}}`, a `str.format` template: `{value}`
    is the value in YAML spelling, `{not_value}` its negation; a command-line switch starts with `{switch}`: `add` or
    `remove`). `training` is False for a config that trains nothing (LLaMA-Factory chat / export configs);
    `changes_for` holds `LauncherRule.change` by rule id; `extra` values a launcher module keeps between reading and
    finishing (not facts); `unread` what the reader could not read and the verdict depends on (a shell variable set
    from the environment in a flag the rules read, a file the config names that is not here): the check then says
    `incomplete`, never `ok`.
    """

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

    def value(self, name: str, default: Any = None) -> Any:
        fact = self.facts.get(name)
        return default if fact is None else fact.value

    def apply(
        self,
        rules: tuple[LauncherRule, ...],
        view: Any,
        version: str,
        before: Callable[[LauncherRule], Any],
        source: Callable[[LauncherRule], str] = lambda rule: "user",
    ) -> None:
        """Add the decision of every rule of `rules` whose predicate holds for `view`; `before(rule)` is the value
        the rule is about, `source(rule)` who set it."""
        for rule in rules:
            if rule.when(view):
                self.decisions.append(rule.decision(version, before=before(rule), source=source(rule)))
                if rule.change:
                    self.changes_for[rule.id] = rule.change

    def reentrant_source(self) -> str:
        """Who set the `use_reentrant` the engine sees, in the words of a decision's `source`."""
        value = self.value("use_reentrant_source", "unset")
        return f"launcher ({self.format})" if value == "unknown" else str(value)


# --- typed access ----------------------------------------------------------------------------------------------


def where(path: str, key: str, lines: Mapping[str, int] | None = None) -> str:
    """`path: key 'k' (line n)`: the prefix of every message about a key."""
    top = key.split(".", 1)[0]
    line = (lines or {}).get(top)
    return f"{path}: key {key!r}" + (f" (line {line})" if line else "")


def expect_mapping(
    value: Any, path: str, key: str, lines: Mapping[str, int] | None = None, example: str = ""
) -> dict[str, Any]:
    """`value` when it is a mapping with string keys; `ConfigError` naming the key otherwise."""
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
    """A mapping, or a JSON object written as a string (`'{"use_reentrant": false}'`, which `TrainingArguments`
    decodes itself); `ConfigError` for anything else."""
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

TRUE_WORDS = frozenset({"yes", "true", "t", "y", "1"})
FALSE_WORDS = frozenset({"no", "false", "f", "n", "0"})


def string_to_bool(text: str) -> bool | None:
    """How argparse-based parsers read a boolean option (`transformers.hf_argparser.string_to_bool`, which TRL's
    `TrlParser` uses): yes/true/t/y/1 and no/false/f/n/0, any case; None for anything else (the parser refuses)."""
    low = text.lower()
    if low in TRUE_WORDS:
        return True
    if low in FALSE_WORDS:
        return False
    return None


def yaml_bool(value: bool) -> str:
    return "true" if value else "false"
