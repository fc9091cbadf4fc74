"""What the rules decide about: each setting a `Decision` names, in one table. For each: how its value and who set it
are read off the `Facts` (the engine) and how a refusal says what to change (`errors.raise_for_errors`). How a
decision on it is carried out on the arguments and the live model is `model.write`'s (`WRITERS`, `UNDO`: they touch
torch and transformers objects, which `core` does not import)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .facts import Facts
from .rules import unread_layer_kwargs


@dataclass(frozen=True)
class Target:
    """One setting the rules decide about.

    Args:
        name: as `Decision.setting` spells it.
        read: its value and who set it, from the facts; None for `use_reentrant` (the engine follows it through its
            own repairs) and for what only the runtime sees.
        change: the line a refusal shows to say what to change, `{value}` the value to set; None: the rule's
            message says it.
    """

    name: str
    read: Callable[[Facts], tuple[Any, str]] | None = None
    change: str | None = None


def _fact(field: str, source: str) -> Callable[[Facts], tuple[Any, str]]:
    return lambda facts: (getattr(facts, field), source)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "use_reentrant",
            change="gradient_checkpointing_kwargs={{'use_reentrant': {value!r}}} (activation_checkpointing_kwargs on "
            "transformers >= 5.23)",
        ),
        Target("model.use_reentrant"),
        Target("activation_checkpointing_kwargs"),
        Target("gradient_checkpointing_kwargs"),
        Target(
            "activation_checkpointing",
            lambda facts: (facts.gc_enabled, facts.gc_flag_source),
            "gradient_checkpointing={value!r} (activation_checkpointing on transformers >= 5.23)",
        ),
        Target("model.config.use_cache", _fact("use_cache", "model config")),
        Target("preserve_rng_state", _fact("preserve_rng_state", "user")),  # only ever written by the user
        Target("offload", _fact("offload", "user")),
        Target("fsdp_activation_checkpointing", _fact("fsdp_activation_checkpointing", "user")),
        Target("activation_offloading", _fact("trl_activation_offloading", "user")),
        Target("checkpointing_kwargs.container", _fact("kwargs_problem", "user")),  # what is wrong with them
        Target("checkpointing_kwargs", lambda facts: (unread_layer_kwargs(facts), "user")),  # what torch must not get
        Target("checkpointing_kwargs.unknown", lambda facts: (list(facts.kwargs_unknown), "user")),
        Target("checkpoint_wrapper", _fact("checkpoint_wrapped", "launcher")),
        Target("fp8", _fact("fp8", "model")),
        Target("inputs_require_grad", _fact("inputs_require_grad", "model")),
        Target("parallelism_config.cp_size", _fact("cp_size", "user")),
        Target("first_step_checks", lambda facts: (None, "plugin")),  # the plugin's own
    )
}


def current(facts: Facts, setting: str, *fallback: Any) -> tuple[Any, str]:
    """The value of `setting` and who set it (`fallback`, the value and its source, for a setting without a fact)."""
    target = TARGETS.get(setting)
    if target is not None and target.read is not None:
        return target.read(facts)
    if fallback:
        return fallback[0], fallback[1]
    raise KeyError(f"no fact for setting {setting!r}")
