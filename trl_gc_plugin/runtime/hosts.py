"""What the plugin adapts to inside Axolotl run without its `plugins:` line (`TRL_GC_PLUGIN=1 axolotl train`; the
Axolotl plugin calls the same code): Axolotl's logging filter hides non-`axolotl*` INFO records, so the plugin's
loggers get Axolotl's own rule; and Axolotl writes `use_reentrant` itself, so the YAML (from `register(cfg)` or the
process's `.yml` argument, read as YAML only) tells the user's value from Axolotl's.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from .._base import report
from ..model import probe

AXOLOTL = "launcher (axolotl)"  # who wrote a `use_reentrant` not in the YAML, in `trl-gc-check`'s words


class _AsAxolotl(logging.Filter):
    """Axolotl's filter, with the plugin counted as Axolotl's own (shown from `AXOLOTL_LOG_LEVEL`)."""

    def __init__(self, axolotl_filter: Any) -> None:
        super().__init__()
        self.inner = axolotl_filter

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.inner.axolotl_level or bool(self.inner.filter(record))


def show_under_axolotl() -> None:
    module = sys.modules.get("axolotl.logging_config")
    axolotl_filter = getattr(module, "AxolotlOrWarnErrorFilter", None)
    if axolotl_filter is None:  # Axolotl's logging not set up: nothing hides the plugin
        return
    for log in (report.logger, report.details):
        for found in list(log.filters):
            if isinstance(found, axolotl_filter):
                log.removeFilter(found)
                log.addFilter(_AsAxolotl(found))


def yaml_reentrant(raw: Any) -> tuple[bool, Any]:
    """(whether the YAML itself sets `gradient_checkpointing_kwargs.use_reentrant`, its value)."""
    kwargs = raw.get("gradient_checkpointing_kwargs") if hasattr(raw, "get") else None
    if isinstance(kwargs, dict) and kwargs.get("use_reentrant") is not None:
        return True, kwargs["use_reentrant"]
    return False, None


def config_from_argv() -> tuple[bool, Any] | None:
    import yaml

    for arg in sys.argv[1:]:
        if arg.lower().endswith((".yml", ".yaml")) and os.path.isfile(arg):
            try:
                with open(arg, encoding="utf-8") as fh:
                    return yaml_reentrant(yaml.safe_load(fh))
            except (OSError, ValueError, yaml.YAMLError):
                return None
    return None


def label_axolotl_value(args: Any, given: tuple[bool, Any]) -> None:
    """Record `use_reentrant` in the arguments as Axolotl's where the YAML did not set that value."""
    kwargs = getattr(args, probe.kwargs_field(args), None)
    value = kwargs.get("use_reentrant") if isinstance(kwargs, dict) else None
    in_yaml, yaml_value = given
    if value is not None and not (in_yaml and value == yaml_value):  # else the user's own: "yours" is right
        probe.remember(args, value, AXOLOTL)


def adopt(args: Any) -> None:
    """Inside Axolotl: the plugin's lines shown under its logging, the `use_reentrant` Axolotl wrote labelled as its."""
    if not any(name.startswith("axolotl.cli") for name in list(sys.modules)):  # not Axolotl's CLI
        return
    show_under_axolotl()
    given = config_from_argv()
    if given is not None:
        label_axolotl_value(args, given)
