"""How the plugin talks: stdlib logging, the conventions of the Trainer it lives in, each message once per process.

`trl_gc_plugin` carries the run's one-line summary (INFO), warnings and refusals; `trl_gc_plugin.decisions` one line
per decision (its INFO lines show with the Trainer's `log_level="info"`). As transformers does for its own logger, the
plugin gives `trl_gc_plugin` a stderr handler and stops propagation unless the application configured it first. Only
the main process logs; a launcher that builds the arguments before starting the training processes says each once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

from .flags import launcher_main_process

logger = logging.getLogger("trl_gc_plugin")
details = logging.getLogger("trl_gc_plugin.decisions")

_LEVELS = {name: getattr(logging, name.upper()) for name in ("debug", "info", "warning", "error", "critical")}
_state: dict[str, Any] = {"handler": None, "owns_levels": False}
_seen: set[str] = set()

# `<pid>:<digest>,...`: the post-init decision lines process `<pid>` logged, which its direct children do not repeat
SAID_ENV = "_TRL_GC_PLUGIN_SAID"


def short(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters (error messages quote what they found, never a whole file)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _said(pid: int) -> frozenset[str]:
    """The digests `SAID_ENV` holds for process `pid` (none when it names another process)."""
    owner, _, digests = os.environ.get(SAID_ENV, "").partition(":")
    return frozenset(filter(None, digests.split(","))) if owner == str(pid) else frozenset()


_INHERITED = _said(os.getppid())


def _said_by_parent(decision: Any) -> bool:
    """A post-init decision line the parent process logged already; else remember it for this one's children."""
    if getattr(decision, "stage", None) != "post_init":
        return False
    digest = hashlib.blake2b(decision.line().encode(), digest_size=6).hexdigest()
    if digest in _INHERITED:
        return True
    own = _said(os.getpid())
    if digest not in own:
        with contextlib.suppress(Exception):  # putenv refused: the children say it again, which is all it costs
            os.environ[SAID_ENV] = f"{os.getpid()}:" + ",".join(sorted(own | {digest}))
    return False


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, as transformers' own handler; a line written while a tqdm progress bar is live on the same stream (the
    Trainer's, until `on_train_end` has closed it) goes between the bar's redraws, never onto the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        bar_class = getattr(sys.modules.get("tqdm"), "tqdm", None)  # never imported for this: only live bars matter
        write_mode = getattr(bar_class, "external_write_mode", None)
        if not getattr(bar_class, "_instances", None) or write_mode is None:
            super().emit(record)
            return
        try:
            with write_mode(file=self.stream):
                super().emit(record)
        except Exception:  # never let a log line fail the run
            self.handleError(record)


def setup() -> None:
    """Give `trl_gc_plugin` a handler and default levels, once, unless the application configured it already."""
    if _state["handler"] is not None:
        return
    if logger.handlers or logger.level != logging.NOTSET or details.level != logging.NOTSET:
        _state["handler"] = False  # configured by the application: leave it alone
        return
    handler = _Handler()
    handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    details.setLevel(logging.WARNING)
    _state.update(handler=handler, owns_levels=True)


def follow_trainer(args: Any) -> None:
    """Set the levels from `args.log_level` (`passive`: the defaults) while they are the plugin's own."""
    setup()
    if not _state["owns_levels"]:
        return
    name = str(getattr(args, "log_level", "passive") or "passive").lower()
    logger.setLevel(_LEVELS.get(name, logging.INFO))
    details.setLevel(_LEVELS.get(name, logging.WARNING))


def is_main_process(args: Any = None) -> bool:
    """Rank 0 of `args`' distributed state when given, else of the launcher's environment."""
    if args is not None:
        with contextlib.suppress(Exception):  # args not fully built, or no distributed state yet
            return int(args.process_index) == 0
    return launcher_main_process()


def once(log: logging.Logger, level: int, message: str) -> bool:
    """Log `message` unless this process logged it before; True if it was logged."""
    if message in _seen:
        return False
    _seen.add(message)
    log.log(level, message)
    return True


def log_decisions(decisions: Iterable[Any], main_process: bool = True) -> None:
    """Log each decision on `trl_gc_plugin.decisions` at its level (main process only, once per process)."""
    if not main_process:
        return
    setup()
    for decision in decisions:
        if not _said_by_parent(decision):
            once(details, _LEVELS[decision.level], decision.line())


def note(message: str, level: str = "info", main_process: bool = True) -> None:
    """A message of the plugin's own (not a decision) on `trl_gc_plugin`, once per process."""
    if main_process:
        setup()
        once(logger, _LEVELS[level], message)


def summary_line(decisions: list[Any], mode: str, use_reentrant: Any, source: str, json_path: str | None) -> str:
    """The run's one-line summary: what runs, what the plugin changed or would change, where the decisions are."""
    where = f"; decisions in {json_path}" if json_path else ""
    flagged = sorted({d.rule_id for d in decisions if d.level in ("warning", "error")})  # a check said at two stages
    said = f"; {len(flagged)} warning(s)/refusal(s): " + ", ".join(flagged) if flagged else ""
    if any(d.rule_id == "checkpointing-off" for d in decisions):
        return f"gradient checkpointing is off (mode={mode}){said}{where}."
    who = {
        "plugin": "chosen by the plugin",
        "user": "yours",
        "trainer": "set by the trainer",
        "unset": "unset",
        "unknown": "set before the plugin saw it",
    }.get(source, f"set by {source}")
    running = "the library default" if use_reentrant is None else repr(use_reentrant)
    changed = sorted({f"{d.setting}={d.after!r}" for d in decisions if d.applied and d.setting != "use_reentrant"})
    parts = [f"gradient checkpointing on, use_reentrant={running} ({who}), mode={mode}"]
    if changed:
        parts.append("also set: " + ", ".join(changed))
    return "; ".join(parts) + said + where + " (`log_level=info` lists every decision)."


def reset() -> None:
    """Forget which messages were logged, and undo `setup()`."""
    _seen.clear()
    handler = _state["handler"]
    if handler:
        logger.removeHandler(handler)
        logger.propagate = True
    if _state["owns_levels"]:
        logger.setLevel(logging.NOTSET)
        details.setLevel(logging.NOTSET)
    _state.update(handler=None, owns_levels=False)
