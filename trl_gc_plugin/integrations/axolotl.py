"""The Axolotl plugin: `plugins: [trl_gc_plugin.integrations.axolotl.SafeGCPlugin]` in an Axolotl config.

`register(cfg)` keeps what the raw YAML says about `use_reentrant`; `get_input_args()` adds the `trl_gc_*` keys; the
callback goes to the Trainer's constructor (a post-trainer one would miss `on_init_end`). Axolotl's `PluginManager`
only logs an `ImportError` and trains on unchecked, so a failed import here raises `RuntimeError`.
"""

from __future__ import annotations

from typing import Any

try:
    from axolotl.integrations.base import BasePlugin
    from pydantic import BaseModel, model_validator

    from .._base import report
    from ..core.settings import CALLBACK_SETTINGS, GCSettings
    from ..routes.callback import SafeGCCallback
    from ..runtime import hosts
except ImportError as exc:  # PluginManager only logs an ImportError and trains on without the plugin
    raise RuntimeError(
        f"trl_gc_plugin's Axolotl plugin could not be loaded ({exc}); training without it would run unchecked. "
        "Install trl-gc-plugin and axolotl in the same environment, or remove the line from `plugins:`."
    ) from exc

PLUGIN_LINE = f"{__name__}.SafeGCPlugin"
OFFLOADING_OWNS = ("true", "legacy", "disk")  # `activation_offloading` values with which Axolotl checkpoints itself


def config_key(name: str) -> str:
    return "trl_gc_" + name


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


class SafeGCArgs(BaseModel):
    """The plugin's keys in an Axolotl config, checked by the settings layer (the plugin's messages), not pydantic."""

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
    """The settings from an Axolotl config (a mapping or the validated model); `GCConfigError` (a `ValueError`,
    which pydantic reports) for a bad value."""
    return GCSettings.resolve({s.name: _get(cfg, config_key(s.name)) for s in CALLBACK_SETTINGS}, caller="axolotl")


class AxolotlSafeGCCallback(SafeGCCallback):
    """`SafeGCCallback` with what only the Axolotl config tells: who wrote `use_reentrant`, and whether Axolotl's
    activation offloading owns checkpointing."""

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


class SafeGCPlugin(BasePlugin):
    """Safe gradient checkpointing for Axolotl: `plugins: [trl_gc_plugin.integrations.axolotl.SafeGCPlugin]`."""

    def __init__(self) -> None:
        super().__init__()
        self.yaml_reentrant: tuple[bool, Any] = (False, None)

    def register(self, cfg: Any) -> None:
        self.yaml_reentrant = hosts.yaml_reentrant(cfg)
        hosts.show_under_axolotl()

    def get_input_args(self) -> str:
        return f"{__name__}.{SafeGCArgs.__name__}"

    def add_callbacks_pre_trainer(self, cfg: Any, model: Any) -> list[Any]:
        hosts.show_under_axolotl()
        resolve(cfg)  # validated already with the config; again here for a caller that skipped the schema
        # only what the config sets: the rest comes from install() / TRL_GC_PLUGIN_* / the defaults, as usual
        given = {s.name: v for s in CALLBACK_SETTINGS if (v := _get(cfg, config_key(s.name))) is not None}
        return [AxolotlSafeGCCallback(self.yaml_reentrant, _get(cfg, "activation_offloading"), **given)]
