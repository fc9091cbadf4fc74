"""The plugin's own settings (`SafeGCCallback(...)`, `install(...)`, `TRL_GC_PLUGIN_*`), one row of `SETTINGS` each,
resolved with one precedence (argument > `install()` > environment > default) and one policy for a bad value: a line
naming the setting, the value and what is accepted; `GCConfigError` in strict mode, else a warning and the default.
Booleans take `transformers.hf_argparser.string_to_bool`'s forms plus `on`/`off`, a bool, 0 and 1; sizes
`units.parse_size`'s. `docs/settings.md` holds `markdown_table()`. (The Trainer's checkpointing kwargs: `kwargs`.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from .._base import report
from .._base.flags import FORMS, launcher_main_process, parse_flag
from .._base.report import short
from .errors import GCConfigError
from .modes import MODES, Mode
from .units import BUDGET_FORMS, parse_size

BOOL_FORMS = FORMS


def parse_bool(value: Any) -> bool:
    flag = parse_flag(value)
    if flag is None:
        raise ValueError(f"expected {BOOL_FORMS}")
    return flag


def parse_mode(value: Any) -> Mode:
    if isinstance(value, str) and value.strip().lower() in MODES:
        return value.strip().lower()  # type: ignore[return-value]
    raise ValueError(f"expected one of {', '.join(MODES)} (any case)")


def parse_budget(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return parse_size(value)
    except ValueError:
        raise ValueError(f'expected {BUDGET_FORMS}, or "auto"') from None


def parse_dir(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise ValueError("expected a directory path")
    return value.strip()


@dataclass(frozen=True)
class Setting:
    """One of the plugin's settings: `parse` raises `ValueError` for what is not `accepted`; `callback`: a keyword of
    `SafeGCCallback` (and a `trl_gc_*` key of the Axolotl plugin), False for `guard()`-only settings."""

    name: str
    env: str | None
    accepted: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    installable: bool = False
    callback: bool = True


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "mode",
        "TRL_GC_PLUGIN_MODE",
        "strict, fix or warn (any case)",
        parse_mode,
        "strict",
        "strict: refuse an explicit choice known to break training; fix: override it loudly; warn: change nothing. "
        "A bad value of this variable is reported and strict is used (there is no mode yet to judge it by).",
        installable=True,
    ),
    Setting(
        "audit",
        "TRL_GC_PLUGIN_AUDIT",
        BOOL_FORMS,
        parse_bool,
        True,
        "the first-step gradient audit of every checkpointed block",
    ),
    Setting(
        "parity_check",
        None,
        BOOL_FORMS + ", or None (on for reentrant single-process runs)",
        parse_bool,
        None,
        "compare gradients with and without checkpointing once, at the first optimizer step",
    ),
    Setting(
        "write_json",
        None,
        BOOL_FORMS,
        parse_bool,
        True,
        "write the decisions to <output_dir>/gc_decisions.json",
    ),
    Setting(
        "memory_budget",
        "TRL_GC_PLUGIN_BUDGET",
        'a size ("40GiB", "512MiB", "1.5GB", bytes as an int) or "auto" (free CUDA memory)',
        parse_budget,
        None,
        "plan how much to checkpoint within this activation memory per device",
        installable=True,
    ),
    Setting(
        "output_dir",
        "TRL_GC_PLUGIN_OUTPUT_DIR",
        "a directory path (an existing directory: the plugin creates none)",
        parse_dir,
        None,
        "where a loop without a Trainer writes gc_decisions.json (`guard(output_dir=...)`; a Trainer writes to its "
        "own output_dir); none: logs only",
        callback=False,
    ),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
CALLBACK_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.callback)
"""The settings `SafeGCCallback` takes (and the Axolotl plugin's `trl_gc_*` keys)."""


def problem_line(setting: Setting, where: str, value: Any) -> str:
    """The one line said for a bad value: which setting, where it came from, the value, what is accepted."""
    return f"{where}: got {short(value, 80)}; {setting.name} accepts {setting.accepted}"


@dataclass(frozen=True)
class GCSettings:
    """The settings one `SafeGCCallback` runs with, resolved once; `problems`: the bad values reported in fix/warn
    mode."""

    mode: Mode = "strict"
    audit: bool = True
    parity_check: bool | None = None
    write_json: bool = True
    memory_budget: int | str | None = None
    output_dir: str | None = None
    problems: tuple[str, ...] = ()
    origins: tuple[tuple[str, str], ...] = ()
    """(setting, where its value came from: `guard(output_dir=...)`, `TRL_GC_PLUGIN_OUTPUT_DIR`, ...) for the values
    that are not defaults."""

    @classmethod
    def resolve(
        cls,
        given: Mapping[str, Any],
        installed: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        caller: str = "SafeGCCallback",
        say: bool = True,
    ) -> GCSettings:
        """Resolve every setting: `given[name]` when not None, else `installed`, else the environment, else the
        default. A bad value is said (`say`) and its default used; `GCConfigError` for a bad `mode` argument, and in
        strict mode for any other bad value."""
        installed = INSTALLED if installed is None else installed
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {s.name: s.default for s in SETTINGS}
        bad: list[tuple[Setting, str, Any]] = []
        origins: list[tuple[str, str]] = []
        for setting in SETTINGS:
            name = setting.name
            if given.get(name) is not None:
                where, raw = f"{caller}({name}=...)", given[name]
            elif installed.get(name) is not None:
                where, raw = f"install({name}=...)", installed[name]
            elif setting.env and str(environ.get(setting.env, "")).strip():
                where, raw = setting.env, environ[setting.env]
            else:
                continue
            try:
                values[name] = setting.parse(raw)
                origins.append((name, where))
            except ValueError:
                if name == "mode" and where != setting.env:
                    raise GCConfigError(problem_line(setting, where, raw)) from None
                bad.append((setting, where, raw))
        lines = tuple(problem_line(s, w, v) for s, w, v in bad)
        refusing = [line for (s, _, _), line in zip(bad, lines, strict=True) if s.name != "mode"]
        if refusing and values["mode"] == "strict":
            raise GCConfigError(
                "trl_gc_plugin refused its settings (mode=strict): "
                + "; ".join(refusing)
                + ". Fix the value, or use mode='warn'/'fix' to go on with the default."
            )
        for line in lines if say else ():
            report.note(f"{line}; using the default.", "warning", launcher_main_process())
        return cls(**values, problems=lines, origins=tuple(origins))

    def origin(self, name: str) -> str:
        """Where the value of setting `name` came from (`name` itself for a default)."""
        return dict(self.origins).get(name, name)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("problems", "origins")}


INSTALLED: dict[str, Any] = {}
"""What `install()` was given (`mode`, `memory_budget`) while it is installed: the second place `resolve` looks."""


def markdown_table() -> str:
    """The settings as a Markdown table (`docs/settings.md`)."""
    head = "| setting | `install()` | environment | accepted | default | what it does |\n|---|---|---|---|---|---|"
    rows = (
        f"| `{s.name}` | {'yes' if s.installable else 'no'} | {f'`{s.env}`' if s.env else '-'} | {s.accepted} "
        f"| `{s.default!r}` | {s.help} |"
        for s in SETTINGS
    )
    return "\n".join([head, *rows])
