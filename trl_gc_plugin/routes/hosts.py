"""What the plugin adapts to inside a launcher that runs it without the launcher's own integration: `TRL_GC_PLUGIN=1
axolotl train cfg.yml`, no `plugins:` line (the Axolotl plugin, `integrations/axolotl.py`, calls the same code).

Axolotl, the only host modelled so far:

- its logging (`axolotl.logging_config`) gives every logger created after it started an `AxolotlLogger` whose filter
  drops records of non-`axolotl*` loggers below `LOG_LEVEL` (WARNING by default): the plugin's INFO summary was
  hidden. `show_under_axolotl` gives the plugin's two loggers Axolotl's own rule instead (shown from
  `AXOLOTL_LOG_LEVEL`, INFO by default).
- it writes `use_reentrant` into the arguments itself (`normalize_config`: `{use_reentrant: true}`; the builder
  `{use_reentrant: false}` when the kwargs are unset), which the plugin read as the user's. The YAML tells the
  user's value from Axolotl's: the plugin route reads it in `register(cfg)`, the environment route from the config
  file `axolotl` was started with (`config_from_argv`: the first existing `.yml` / `.yaml` argument; the file is read
  as YAML, nothing it names is imported).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from .._base import report
from ..model import probe

AXOLOTL = "launcher (axolotl)"
"""Who wrote a `use_reentrant` that is not in the YAML (the words `trl-gc-check` uses for the same value)."""


def axolotl_running() -> bool:
    """This process runs Axolotl's CLI (`axolotl train`, `accelerate launch -m axolotl.cli.train`)."""
    return any(name.startswith("axolotl.cli") for name in list(sys.modules))


class _AsAxolotl(logging.Filter):
    """Axolotl's filter for the plugin's loggers, with the plugin counted as Axolotl's own: a record shows from
    `AXOLOTL_LOG_LEVEL`, or wherever Axolotl's filter lets it through."""

    def __init__(self, axolotl_filter: Any) -> None:
        super().__init__()
        self.inner = axolotl_filter

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.inner.axolotl_level or bool(self.inner.filter(record))


def show_under_axolotl() -> None:
    """Replace the filter Axolotl's `AxolotlLogger` put on the plugin's loggers by `_AsAxolotl` (idempotent)."""
    module = sys.modules.get("axolotl.logging_config")
    axolotl_filter = getattr(module, "AxolotlOrWarnErrorFilter", None)
    if axolotl_filter is None:  # Axolotl's logging not set up (or an Axolotl without it): nothing hides the plugin
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


def config_from_argv(argv: list[str] | None = None) -> tuple[bool, Any] | None:
    """`yaml_reentrant` of the config file the process was started with, None when there is none to read."""
    import yaml

    for arg in (sys.argv if argv is None else argv)[1:]:
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
    if value is None:
        return
    in_yaml, yaml_value = given
    if in_yaml and value == yaml_value:
        return  # the user's own: the plugin's usual reading ("yours") is right
    probe.remember(args, value, AXOLOTL)


def adopt(args: Any, given: tuple[bool, Any] | None = None) -> None:
    """Inside Axolotl: the plugin's lines shown under its logging, and the `use_reentrant` Axolotl wrote labelled as
    its own (`given`: what the YAML says, read from the process's config file when not given). Nothing elsewhere."""
    if not axolotl_running():
        return
    show_under_axolotl()
    given = given if given is not None else config_from_argv()
    if given is not None:
        label_axolotl_value(args, given)
