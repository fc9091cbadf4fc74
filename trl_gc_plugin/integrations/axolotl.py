"""The Axolotl plugin: `plugins: [trl_gc_plugin.integrations.axolotl.SafeGCPlugin]` in an Axolotl config.

What it does, hook by hook (Axolotl's `BasePlugin`, `axolotl.integrations.base`):

- `register(cfg)` (the raw YAML, before validation): keeps what the file itself says about `use_reentrant`, so the
  plugin can later tell the user's value from the one Axolotl wrote (`normalize_config` writes
  `{use_reentrant: true}`, the builder `{use_reentrant: false}` when the kwargs are unset), and makes the plugin's
  lines visible under Axolotl's logging (below).
- `get_input_args()`: the config keys `trl_gc_mode`, `trl_gc_memory_budget`, `trl_gc_audit`, `trl_gc_parity_check`,
  `trl_gc_write_json` (`SafeGCArgs`, a pydantic model Axolotl merges into its config schema), validated by the
  plugin's one settings layer (`GCSettings.resolve(..., caller="axolotl")`: the same one-line messages as
  `SafeGCCallback(...)`; a bad `trl_gc_mode`, or any bad value in strict mode, refuses the config).
- `add_callbacks_pre_trainer(cfg, model)`: the `SafeGCCallback`. Pre-trainer callbacks are passed to the Trainer's
  constructor, so the callback sees `on_init_end` (where it decides and fixes the arguments) and comes before
  Axolotl's own callbacks (its reporters among them) in the list; a post-trainer callback is added after the
  Trainer's `__init__` and would miss `on_init_end`.

What the plugin adapts to inside Axolotl (its logging filter, the `use_reentrant` it writes itself) is
`routes/hosts.py`, shared with the `TRL_GC_PLUGIN=1` route, which needs no `plugins:` line.

A plugin that fails to import is logged by Axolotl's `PluginManager` (ERROR and a traceback) and training goes on
without it. This module therefore turns an `ImportError` of its own imports into a `RuntimeError`, which
`PluginManager` does not catch: `axolotl train` stops. A misspelled module path cannot be caught here (this code
never runs); `trl-gc-check cfg.yml` reads the `plugins:` list.
"""

from __future__ import annotations

from typing import Any

try:
    from axolotl.integrations.base import BasePlugin
    from pydantic import BaseModel, model_validator

    from .._base import report
    from ..core.settings import CALLBACK_SETTINGS, GCSettings
    from ..routes import hosts
    from ..routes.callback import SafeGCCallback
except ImportError as exc:  # PluginManager only logs an ImportError and trains on without the plugin
    raise RuntimeError(
        f"trl_gc_plugin's Axolotl plugin could not be loaded ({exc}); training without it would run unchecked. "
        "Install trl-gc-plugin and axolotl in the same environment, or remove the line from `plugins:`."
    ) from exc

PLUGIN_LINE = f"{__name__}.SafeGCPlugin"
KEY_PREFIX = "trl_gc_"
SOURCE = hosts.AXOLOTL
OFFLOADING_OWNS = ("true", "legacy", "disk")
"""`activation_offloading` values with which Axolotl turns the Trainer's checkpointing off and checkpoints itself."""


def config_key(name: str) -> str:
    return KEY_PREFIX + name


class SafeGCArgs(BaseModel):
    """The plugin's keys in an Axolotl config (one per setting of `trl_gc_plugin.core.settings`, prefixed `trl_gc_`).
    Values are checked by the settings layer, not by pydantic's types, so the messages are the plugin's."""

    trl_gc_mode: Any = None
    trl_gc_audit: Any = None
    trl_gc_parity_check: Any = None
    trl_gc_write_json: Any = None
    trl_gc_memory_budget: Any = None

    @model_validator(mode="after")
    def _resolve_trl_gc(self) -> SafeGCArgs:
        resolved = resolve(self)  # a bad value is said (or refused) by the settings layer
        for name, value in resolved.as_dict().items():  # the callback gets clean values, and says nothing twice
            if getattr(self, config_key(name), None) is not None:
                object.__setattr__(self, config_key(name), value)
        return self


assert {config_key(s.name) for s in CALLBACK_SETTINGS} == set(SafeGCArgs.model_fields), (
    "a setting without its Axolotl key"
)


def resolve(cfg: Any) -> GCSettings:
    """The plugin's settings from an Axolotl config (a mapping or the validated model); `GCConfigError` (a
    `ValueError`, which pydantic reports as a validation error) for a bad value, as `SafeGCCallback` would."""
    get = cfg.get if hasattr(cfg, "get") else lambda key: getattr(cfg, key, None)
    return GCSettings.resolve({s.name: get(config_key(s.name)) for s in CALLBACK_SETTINGS}, caller="axolotl")


show_under_axolotl = hosts.show_under_axolotl


class AxolotlSafeGCCallback(SafeGCCallback):
    """`SafeGCCallback` with what only the Axolotl config tells: who wrote `use_reentrant`, and whether Axolotl's
    activation offloading owns checkpointing (then a model that checkpoints while the arguments say off is not
    checkpointing "not asked for")."""

    def __init__(self, yaml_reentrant: tuple[bool, Any], offloading: Any, **settings: Any) -> None:
        self.yaml_reentrant = yaml_reentrant
        self.offloading = offloading
        if str(offloading).lower() in OFFLOADING_OWNS:
            self.offloader = f"Axolotl activation_offloading={offloading}"
        super().__init__(**settings)

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        try:
            hosts.label_axolotl_value(args, self.yaml_reentrant)
        except Exception as exc:  # never stop a run over a label
            report.note(f"could not tell who wrote use_reentrant ({exc!r}); the summary may call it yours", "info")
        super().on_init_end(args, state, control, model=model, **kwargs)


_yaml_reentrant = hosts.yaml_reentrant


class SafeGCPlugin(BasePlugin):
    """Safe gradient checkpointing for Axolotl: `plugins: [trl_gc_plugin.integrations.axolotl.SafeGCPlugin]`."""

    def __init__(self) -> None:
        super().__init__()
        self.yaml_reentrant: tuple[bool, Any] = (False, None)

    def register(self, cfg: Any) -> None:
        self.yaml_reentrant = _yaml_reentrant(cfg)
        show_under_axolotl()

    def get_input_args(self) -> str:
        return f"{__name__}.{SafeGCArgs.__name__}"

    def add_callbacks_pre_trainer(self, cfg: Any, model: Any) -> list[Any]:
        show_under_axolotl()
        get = cfg.get if hasattr(cfg, "get") else lambda key: getattr(cfg, key, None)
        resolve(cfg)  # validated already with the config; again here for a caller that skipped the schema
        given = {s.name: get(config_key(s.name)) for s in CALLBACK_SETTINGS if get(config_key(s.name)) is not None}
        # only what the config sets: the rest comes from install() / TRL_GC_PLUGIN_* / the defaults, as usual
        return [AxolotlSafeGCCallback(self.yaml_reentrant, get("activation_offloading"), **given)]
