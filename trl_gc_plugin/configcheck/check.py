"""`trl-gc-check`: each file read as its launcher reads it (its own parser in a subprocess where it can run, else the
plugin's model of it), then `engine.decide` beside the launcher's own verdicts. Exit status: 0 fine; 1 refused; 2
unreadable, unrecognised, `incomplete` (the verdict depends on what could not be read) or an invalid option. Nothing
raises out of `check_files`: a bug is an error for that file.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from .._base.flags import parse_flag
from ..core import capabilities
from ..core.capabilities import installed_versions
from ..core.decisions import Decision, first_sentence
from ..core.engine import applicable, decide
from ..core.facts import Facts
from ..core.modes import Mode
from . import detect
from .launchers import LAUNCHERS, parse_command
from .read import native
from .read.common import ConfigError, Context, Fact, NotTrainingConfig, Reading, yaml_bool
from .read.load import Config
from .read.load import load as load_config

__all__ = ["ConfigError", "Launch", "Report", "check_files", "render", "render_json", "summary"]

PACKAGES = ("transformers", "trl", "peft", "torch", "deepspeed")
ASSUMED_VERSIONS = {
    "deepspeed": ("0.9.3", "the oldest DeepSpeed transformers supports"),
    "transformers": ("4.53.2", "the oldest transformers the plugin supports"),
}
"""Versions assumed (and said) when a package is neither installed nor given: the rules for old releases apply."""

COMPILE_KEY = "torch_compile"
"""The `TrainingArguments` field (TRL, LLaMA-Factory and Axolotl configs pass it through) that compiles the model."""
PRECISION_KEYS = ("bf16", "fp16")
LAUNCHER_RULES = {rule.id: rule for launcher in LAUNCHERS.values() for rule in launcher.rules}
READ_KEYS = frozenset().union(*(launcher.read_keys for launcher in LAUNCHERS.values()), {COMPILE_KEY})
"""Every top-level key some launcher reads: only these values are built from a YAML file."""

FACT_FIELDS = frozenset(f.name for f in dataclasses.fields(Facts))
Status = Literal["ok", "refused", "incomplete", "error"]


@dataclass(frozen=True)
class Launch:
    """The check's options. `parser`: `auto` (the launcher's own code where it can run, else the plugin's model),
    `launcher` (only its own code) or `model`; `timeout`: seconds for the launchers' own parsers, all files."""

    nproc: int | None = None
    trainer: str | None = None
    versions: tuple[tuple[str, str], ...] = ()
    format: str = "auto"
    parser: str = "auto"
    accelerate_config: str | None = None
    timeout: float = 120.0
    no_script_args: bool = False


@dataclass
class Report:
    """One file's check: `sources` say where each fact came from; `decisions` the launcher's, then the engine's."""

    path: str
    status: Status
    format: str | None = None
    detected_by: str = ""
    parser: str = ""
    facts: Facts | None = None
    sources: dict[str, Fact] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    change: str | None = None
    error: str | None = None
    training: bool = True
    unread: list[str] = field(default_factory=list)
    other: bool = False  # `NotTrainingConfig`: skipped with `--skip-other-files`

    @property
    def exit_code(self) -> int:
        return {"ok": 0, "refused": 1, "incomplete": 2, "error": 2}[self.status]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "status": self.status,
            "exit_code": self.exit_code,
            "format": self.format,
            "detected_by": self.detected_by,
            "parser": self.parser,
            "training": self.training,
            "facts": self.facts.to_dict() if self.facts is not None else None,
            "sources": {name: fact.to_dict() for name, fact in self.sources.items()},
            "decisions": [d.to_dict() for d in self.decisions],
            "change": self.change,
            "notes": list(self.notes),
            "unread": list(self.unread),
            "error": self.error,
        }


def version_facts(launch: Launch, uses_deepspeed: bool) -> dict[str, Fact]:
    """The version of each package the rules gate on: given, installed, or assumed (DeepSpeed only where used)."""
    installed = installed_versions()
    given = dict(launch.versions)
    out: dict[str, Fact] = {}
    for package in PACKAGES:
        if given.get(package):
            out[package] = Fact(given[package], "option", f"--{package}-version")
        elif installed.get(package):
            out[package] = Fact(installed[package], "installed", "installed where the check runs")
        elif package in ASSUMED_VERSIONS and (package != "deepspeed" or uses_deepspeed):
            version, why = ASSUMED_VERSIONS[package]
            out[package] = Fact(
                version,
                "assumed",
                f"not installed here and no --{package}-version: assumed {version}, {why}, so the rules for old "
                f"releases apply; pass --{package}-version for the release the launch uses",
            )
        else:
            out[package] = Fact(None, "installed", "not installed here")
    return out


def _facts(reading: Reading, versions: dict[str, Fact], config: Config) -> Facts:
    if parse_flag(config.values.get(COMPILE_KEY)) is True:
        reading.facts.setdefault("compiled", Fact(f"{COMPILE_KEY}=True", "file", COMPILE_KEY))
    precision = [k for k in PRECISION_KEYS if parse_flag(config.values.get(k)) is True]
    if precision:
        reading.facts.setdefault("mixed_precision", Fact(True, "file", f"key {precision[0]!r}"))
    all_versions: dict[str, str | None] = dict(installed_versions())
    all_versions.update({k: v.value for k, v in versions.items()})
    values = {name: fact.value for name, fact in reading.facts.items() if name in FACT_FIELDS and name != "versions"}
    return Facts(stage="init_end", versions=all_versions, capabilities=capabilities.for_check(all_versions), **values)


ENGINE_CHANGES = {
    "conflict": "upgrade DeepSpeed to >= 0.19.3 (then non-reentrant works under ZeRO-3 and the two rules agree)",
    "invalid-use-reentrant": "write use_reentrant as a boolean: true or false",
}
KWARG_SETTINGS = ("preserve_rng_state", "offload")
"""Settings that are keys of the checkpointing kwargs, spelled like `use_reentrant` in each format."""


def conflicting(facts: Facts | None) -> set[str]:
    """The rules that demand a `use_reentrant` for these facts (two that disagree are the `conflict` refusal)."""
    rules = applicable(facts) if facts is not None else []
    return {r.id for r in rules if r.kind == "require" and r.setting == "use_reentrant"}


def change_line(reading: Reading, decisions: list[Decision], facts: Facts | None = None) -> str | None:
    """The one change to make: for the first refusal (the launcher's own first), in the format's spelling."""
    errors = sorted((d for d in decisions if d.action == "error"), key=lambda d: ":" not in d.rule_id)
    forced: dict[str, str] = reading.extra.get("forced", {})
    for d in errors:
        change = reading.changes_for.get(d.rule_id) or forced.get(d.setting)
        if change:
            return change
        if d.rule_id == "conflict" and "zero3-frozen-needs-reentrant" not in conflicting(facts):
            return "the rules demand opposite use_reentrant values: change the launch (see the decision)"
        if d.rule_id in ENGINE_CHANGES:
            return ENGINE_CHANGES[d.rule_id]
        template = reading.changes.get(d.setting)
        kwargs_template = reading.changes.get("use_reentrant", "")
        if template is None and d.setting in KWARG_SETTINGS and "kwargs" in kwargs_template:
            template = kwargs_template.replace("use_reentrant", d.setting)
        if template and isinstance(d.after, bool):
            line = template.format(
                value=yaml_bool(d.after), not_value=yaml_bool(not d.after), switch="add" if d.after else "remove"
            )
            return line if template.startswith("{switch}") else "set " + line
        return first_sentence(d.reason)
    return None


def _relabel(decisions: list[Decision], reading: Reading) -> list[Decision]:
    """A `use_reentrant` the launcher wrote is `unknown` to the engine (as at runtime); the output names the
    launcher."""
    if reading.value("use_reentrant_source") != "unknown":
        return decisions
    label = f"launcher ({reading.format})"
    return [dataclasses.replace(d, source=label) if d.source == "unknown" else d for d in decisions]


@dataclass
class _Read:
    index: int
    config: Config
    format: str
    why: str
    ctx: Context
    reading: Reading


def _native_jobs(pending: list[_Read], launch: Launch) -> list[dict[str, Any]]:
    if launch.parser == "model":
        return []
    jobs: list[dict[str, Any]] = []
    for p in pending:
        fields = LAUNCHERS[p.format].native_job(p.config, p.ctx)
        if fields is not None:
            jobs.append({"id": p.index, "launcher": p.format, "path": os.path.abspath(p.config.path), **fields})
    return jobs


def check_files(paths: list[str], launch: Launch = Launch(), mode: Mode = "strict") -> list[Report]:
    """One `Report` per file, in order; never raises. The launchers' own parsers read the files in one subprocess."""
    reports: list[Report | None] = [None] * len(paths)
    pending: list[_Read] = []
    for i, path in enumerate(paths):
        try:
            pending.append(_first_read(i, path, launch))
        except NotTrainingConfig as exc:
            reports[i] = Report(path=path, status="error", error=str(exc), other=True)
        except ConfigError as exc:
            reports[i] = Report(path=path, status="error", error=str(exc))
        except Exception as exc:  # a bug in the check: never a traceback, never a verdict
            reports[i] = _internal_error(path, exc)
    jobs = _native_jobs(pending, launch)
    try:
        results = native.run(jobs, launch.timeout)
    except Exception as exc:
        results = {
            job["id"]: {"ok": False, "kind": "environment", "message": f"{type(exc).__name__}: {exc}"} for job in jobs
        }
    for p in pending:
        try:
            reports[p.index] = _finish(p, launch, mode, results.get(p.index))
        except ConfigError as exc:
            reports[p.index] = Report(
                path=p.config.path, status="error", format=p.format, detected_by=p.why, error=str(exc)
            )
        except Exception as exc:
            reports[p.index] = _internal_error(p.config.path, exc)
    return [r for r in reports if r is not None]


def _internal_error(path: str, exc: BaseException) -> Report:
    return Report(
        path=path,
        status="error",
        error=f"{path}: internal error in trl-gc-check ({type(exc).__name__}: {first_sentence(str(exc), 160)}); "
        "this is a bug of the check, not of the config: please report it",
    )


def _first_read(index: int, path: str, launch: Launch) -> _Read:
    config = load_config(path, READ_KEYS, parse_command)
    fmt, why = detect.detect(config, launch.format)
    launcher = LAUNCHERS[fmt]
    refusal = launcher.no_own_parser() if launch.parser == "launcher" else None
    if refusal is not None:
        raise ConfigError(f"{path}: --parser launcher: {refusal}; use --parser auto or model")
    uses_deepspeed = (
        "deepspeed" in config.values or launch.accelerate_config is not None or "accelerate_config" in config.values
    )
    versions = version_facts(launch, uses_deepspeed=uses_deepspeed)
    ctx = Context(
        nproc=launch.nproc,
        trainer=launch.trainer,
        accelerate_config=launch.accelerate_config,
        no_script_args=launch.no_script_args,
        versions={k: v.value for k, v in versions.items()},
        version_origins={k: v.origin for k, v in versions.items()},
    )
    return _Read(index, config, fmt, why, ctx, launcher.read(config, ctx))


def _finish(p: _Read, launch: Launch, mode: Mode, result: dict[str, Any] | None) -> Report:
    config, fmt, ctx, reading = p.config, p.format, p.ctx, p.reading
    launcher = LAUNCHERS[fmt]
    notes: list[str] = []
    parsed = result is not None and result.get("ok")
    if result is not None and parsed:
        reading = launcher.with_native(config, ctx, reading, result)
    if result is not None and not parsed:
        kind, message = result.get("kind"), result.get("message", "")
        launcher_name = launcher.title
        if kind == "usage":
            raise ConfigError(f"{config.path}: {launcher_name}'s own parser refuses it: {message}")
        if kind == "refused":
            if not any(d.action == "error" and ":" in d.rule_id for d in reading.decisions):
                reading.decisions.append(
                    Decision(
                        rule_id=f"{fmt}:refuses",
                        action="error",
                        setting="config",
                        before=None,
                        after=None,
                        source="user",
                        reason=f"{launcher_name}'s own argument parsing refuses this config: {message}",
                        level="error",
                    )
                )
            else:
                notes.append(f"{launcher_name}'s own parser refuses it too: {message}")
        elif launch.parser == "launcher":
            raise ConfigError(
                f"{config.path}: --parser launcher: {launcher_name}'s own parser could not run here: {message}"
            )
        else:
            reading.parser += f" ({launcher_name}'s own parser could not run here: {first_sentence(message, 160)})"
    elif result is None and launch.parser == "launcher":
        raise ConfigError(f"{config.path}: --parser launcher: {fmt}'s own code is not importable here")
    launcher.finish(config, ctx, reading)

    # versions: now that the stage is known, DeepSpeed is assumed only where the config uses it
    versions = version_facts(launch, uses_deepspeed=reading.value("zero_stage") is not None)
    for package, fact in versions.items():
        reading.facts[f"versions.{package}"] = fact
    installed_tf = installed_versions().get("transformers")
    if parsed and versions["transformers"].value != installed_tf:
        notes.append(
            f"parsed with the installed transformers {installed_tf}; the rules are evaluated for "
            f"{versions['transformers'].value}"
        )
    facts = _facts(reading, versions, config)
    decisions = list(reading.decisions) + _relabel(decide(facts, mode), reading)
    refused = any(d.action == "error" for d in decisions)
    return Report(
        path=config.path,
        status="refused" if refused else "incomplete" if reading.unread else "ok",
        format=fmt,
        detected_by=p.why,
        parser=reading.parser,
        facts=facts,
        sources=dict(reading.facts),
        decisions=decisions,
        notes=reading.notes + notes,
        change=change_line(reading, decisions, facts) if refused else None,
        training=reading.training,
        unread=list(reading.unread),
    )


# --- output ----------------------------------------------------------------------------------------------------

SHOWN = (
    ("checkpointing", "gc_enabled"),
    ("use_reentrant", "use_reentrant"),
    ("other checkpointing kwargs", "kwargs_keys"),
    ("checkpointing kwargs nothing reads", "kwargs_unknown"),
    ("offload (transformers' kwarg)", "offload"),
    ("activation offloading (launcher)", "activation_offloading"),
    ("activation offloading (TRL)", "trl_activation_offloading"),
    ("selective checkpointing", "selective"),
    ("PEFT adapter", "is_peft"),
    ("quantization", "quantization"),
    ("frozen parameters", "frozen_params"),
    ("inputs require grad", "inputs_require_grad"),
    ("Unsloth", "unsloth"),
    ("cross-layer shared state", "shared_state_layers"),
    ("dropout", "dropout"),
    ("model.config.use_cache", "use_cache"),
    ("trainer", "trainer_kind"),
    ("processes", "world_size"),
    ("verl strategy", "strategy"),
    ("MoE model", "moe"),
    ("Ulysses sequence parallel size", "ulysses"),
    ("DeepSpeed ZeRO stage", "zero_stage"),
    ("DeepSpeed activation_checkpointing", "deepspeed_activation_checkpointing"),
    ("FSDP", "fsdp"),
    ("FSDP activation checkpointing", "fsdp_activation_checkpointing"),
    ("ddp_find_unused_parameters", "ddp_find_unused_parameters"),
    ("ddp_static_graph", "ddp_static_graph"),
    ("transformers", "versions.transformers"),
    ("trl", "versions.trl"),
    ("peft", "versions.peft"),
    ("deepspeed", "versions.deepspeed"),
)
SHOWN_WHEN_SET = frozenset({"offload", "selective", "unsloth", "activation_offloading", "trl_activation_offloading"})


def _value(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {True: "yes", False: "no", None: "-"}[value]
    if isinstance(value, tuple):
        return ", ".join(map(str, value)) or "-"
    return repr(value) if isinstance(value, str) and value in ("", "true", "false") else str(value)


def strip_links(text: str) -> str:
    """`text` without its source links (`(https://... (what))`): they stay in the JSON, the text keeps the words."""
    while True:
        start = text.find(" (https://")
        start = start if start != -1 else text.find("(https://")
        if start == -1:
            return text
        depth, end = 0, start
        for end in range(text.index("(", start), len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        text = text[:start] + text[end + 1 :]


def render(report: Report) -> str:
    if report.status == "error":
        return f"{report.path}: cannot be checked: {report.error}"
    lines = [f"{report.path}: {report.format} config ({report.detected_by}); read by {report.parser}"]
    if not report.training:
        lines += [f"  - {note}" for note in report.notes]
        lines.append("  verdict: fine (nothing trains: checkpointing does not apply)")
        return "\n".join(lines)
    lines.append("  facts:")
    for label, name in SHOWN:
        fact = report.sources.get(name)
        if fact is None or (name in SHOWN_WHEN_SET and not fact.value):
            continue
        detail = strip_links(fact.detail)
        where = fact.origin + (f": {detail}" if detail else "")
        lines.append(f"    {label:<36} {_value(fact.value):<17} {where}")
    lines.append("  decisions:")
    for d in report.decisions:
        lines.append(f"    {d.line()}")
        rule = LAUNCHER_RULES.get(d.rule_id)
        if rule is not None and rule.disagreement:
            lines.append(f"      disagrees on purpose: {rule.disagreement}")
    if report.notes:
        lines += ["  notes:", *(f"    - {note}" for note in report.notes)]
    if report.unread:
        lines += ["  could not be read (the verdict depends on them):", *(f"    - {what}" for what in report.unread)]
    if report.status == "refused":
        lines.append("  verdict: REFUSED (strict mode, or the launcher itself, stops this run)")
        lines.append(f"  change: {report.change}" if report.change else "  change: see the decisions above")
    elif report.status == "incomplete":
        lines.append(
            f"  verdict: NOT CHECKED IN FULL: nothing refused on what was read, but {len(report.unread)} value(s) "
            "the verdict depends on could not be read (above); check the command as it runs (its values written out)"
        )
    else:
        warned = sum(1 for d in report.decisions if d.action in ("warn", "override"))
        lines.append("  verdict: fine" + (f" ({warned} warning(s) above)" if warned else ""))
    return "\n".join(lines)


def render_brief(report: Report) -> list[str]:
    """One line per finding (`FILE: STATUS [rule] action: reason`), `FILE: ok` for none (a pre-commit hook's)."""
    if report.status == "error":
        return [f"{report.path}: error: {report.error}"]
    lines = [
        f"{report.path}: {report.status} [{d.rule_id}] {d.action}: {first_sentence(d.reason, 200)}"
        for d in report.decisions
        if d.action in ("error", "warn", "override")
    ]
    lines += [f"{report.path}: {report.status}: could not be read: {what}" for what in report.unread]
    if report.change:
        lines.append(f"{report.path}: {report.status}: change: {report.change}")
    return lines or [f"{report.path}: {report.status}"]


def render_json(reports: list[Report]) -> str:
    return json.dumps([r.to_dict() for r in reports], indent=2, default=repr)


def summary(reports: list[Report]) -> str:
    counts = {s: sum(1 for r in reports if r.status == s) for s in ("ok", "refused", "incomplete", "error")}
    partly = f", {counts['incomplete']} read in part" if counts["incomplete"] else ""
    return (
        f"checked {len(reports)} file(s): {counts['ok']} fine, {counts['refused']} refused{partly}, "
        f"{counts['error']} not checked (unreadable, unrecognised or invalid)"
    )


def exit_code(reports: list[Report]) -> int:
    return max((r.exit_code for r in reports), default=0)
