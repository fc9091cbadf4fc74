"""Carry out the decisions with `applied=True`: into the arguments (both field names, one dict object) and the live
model. `WRITERS` holds the writer of each setting of `core.targets.TARGETS` that has one, `UNDO` what takes a write
back off the live model when the run ends."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from ..core.decisions import Decision
from ..core.kwargs import unknown_checkpoint_names
from ..core.targets import TARGETS
from . import ckpt, probe


def _write_fields(args: Any, names: tuple[str, str], value: Any) -> None:
    for name in names:
        if name in getattr(type(args), "__dataclass_fields__", {}):
            setattr(args, name, value)


def write_kwargs(args: Any, kwargs: dict[str, Any] | None) -> None:
    """Store `kwargs` in every kwargs field the args have, as one object (so later in-place edits reach both)."""
    _write_fields(args, (probe.NEW_KWARGS, probe.OLD_KWARGS), dict(kwargs) if kwargs is not None else None)


def write_flag(args: Any, value: bool) -> None:
    _write_fields(args, (probe.NEW_FLAG, probe.OLD_FLAG), value)


def write_use_reentrant(args: Any, model: Any, value: bool | None) -> None:
    """The one writer of `use_reentrant`: into the arguments' checkpointing kwargs (both field names, one dict; `None`
    removes the key: a default withdrawn) where `args` is given, into every checkpointed block of the live `model`
    where it is given. Every write goes through here: a decision's (`apply`: settings `use_reentrant` and
    `model.use_reentrant`), a runtime check's switch (`UseReentrant.switch`), the withdrawal under a launcher. The value
    in force and who chose it are held by `UseReentrant` below; `tests/test_one_writer.py` keeps it so."""
    if args is not None:
        set_args_kwarg(args, "use_reentrant", value)
    if model is not None and value is not None:
        ckpt.set_keyword(model, "use_reentrant", value)


def set_args_kwarg(args: Any, key: str, value: Any) -> None:
    """Set `key` in the kwargs the Trainer reads (`None` removes it), keeping every other key."""
    kwargs = dict(probe.read_kwargs(args) or {})
    if value is None:
        kwargs.pop(key, None)
    else:
        kwargs[key] = value
    write_kwargs(args, kwargs)


class UseReentrant:
    """The `use_reentrant` in force for one run and who chose it (`user`, `plugin`, `trainer`, a launcher, `unknown`
    or `unset`): the run's one holder (`Record.reentrant`), kept beside the one writer. `hold` keeps the arguments'
    post-init record in step (`probe.remember`), so the Trainer's stages carry on from what `__post_init__` decided;
    `switch` writes a runtime check's value (first forward, first step, drift) and holds it as the plugin's."""

    __slots__ = ("source", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.source = "unset"

    def hold(self, value: Any, source: str, args: Any = None) -> None:
        self.value, self.source = value, source
        if args is not None:
            probe.remember(args, value, source)

    def switch(self, args: Any, model: Any, value: bool) -> None:
        write_use_reentrant(args, model, value)
        self.hold(value, "plugin", args)

    def explicit(self) -> bool:
        """Whether `use_reentrant=True` runs by the user's own choice (or one of unknown origin)."""
        return self.value is True and self.source in ("user", "unknown")


class CacheSwitch:
    """`use_cache=False` in every config of the model while training steps run, the user's values whenever the Trainer
    saves or evaluates and after training, so no checkpoint's `config.json` carries the change (nor the originals,
    kept here)."""

    def __init__(self, model: Any) -> None:
        self.configs = [c for c in probe.model_configs(model) if c.use_cache is True]

    def off(self) -> None:
        for config in self.configs:
            config.use_cache = False

    def restore(self) -> None:
        for config in self.configs:
            config.use_cache = True


def apply(decisions: Iterable[Decision], args: Any, model: Any = None) -> list[Decision]:
    """Carry out the applicable decisions through their targets' writers; returns those carried out."""
    done = []
    for d in decisions:
        if not d.applied:
            continue
        if d.setting not in TARGETS:
            raise KeyError(f"no way to apply a decision on {d.setting!r}")
        write = WRITERS.get(d.setting)
        if write is not None and write(d, args, model):
            done.append(d)
    return done


def _use_reentrant(d: Decision, args: Any, model: Any) -> bool:
    write_use_reentrant(args, None, d.after)
    return True


def _legacy_kwargs_won(d: Decision, args: Any, model: Any) -> bool:
    """The deprecated name was written last: it wins, both names hold it."""
    old = getattr(args, probe.OLD_KWARGS, None)
    write_kwargs(args, old if isinstance(old, dict) else None)
    return True


def _new_kwargs_won(d: Decision, args: Any, model: Any) -> bool:
    """The new name was written last: the old names mirror it."""
    write_kwargs(args, probe.read_kwargs(args))
    write_flag(args, bool(getattr(args, probe.NEW_FLAG, False)))
    return True


def _flag(d: Decision, args: Any, model: Any) -> bool:
    write_flag(args, bool(d.after))
    return True


def _model_use_reentrant(d: Decision, args: Any, model: Any) -> bool:
    if model is None:
        return False
    write_use_reentrant(None, model, bool(d.after))
    return True


def _torch_keyword(d: Decision, args: Any, model: Any) -> bool:
    value = None if d.setting == "offload" else d.after  # offload=False: the key goes
    set_args_kwarg(args, d.setting, value)
    if model is not None:
        ckpt.set_keyword(model, d.setting, value)
    return True


def _trl_offloading_off(d: Decision, args: Any, model: Any) -> bool:
    """TRL's offloading, on a machine without an accelerator."""
    args.activation_offloading = False
    return True


def _fsdp_checkpointing_off(d: Decision, args: Any, model: Any) -> bool:
    """Replace FSDP's own activation checkpointing with the Trainer's, non-reentrant: in the arguments, and in
    accelerate's FSDP plugin when the Trainer already built it (it is read when the model is prepared, in train())."""
    config = getattr(args, "fsdp_config", None)
    if isinstance(config, dict):
        config["activation_checkpointing"] = False
    try:
        from accelerate.state import AcceleratorState

        plugin = AcceleratorState._shared_state.get("fsdp_plugin")
        if plugin is not None:
            plugin.activation_checkpointing = False
    except ImportError:
        pass
    write_flag(args, True)
    write_use_reentrant(args, None, False)
    return True


def _kwargs_as_dict(d: Decision, args: Any, model: Any) -> bool:
    """Not a dict: a dict (with `use_reentrant` once decided)."""
    write_kwargs(args, probe.read_kwargs(args) or {})
    return True


def _layer_kwargs_out(d: Decision, args: Any, model: Any) -> bool:
    """Layer kwargs this transformers cannot read: torch must not get them."""
    for key in d.before or ():
        set_args_kwarg(args, key, None)
    return True


def _unknown_keys_out(d: Decision, args: Any, model: Any) -> bool:
    """Keys nothing reads (reentrant torch raises on them)."""
    for key in unknown_checkpoint_names(probe.read_kwargs(args) or {}):
        set_args_kwarg(args, key, None)
        if model is not None:
            ckpt.set_keyword(model, key, None)
    return True


def _input_hook(d: Decision, args: Any, model: Any) -> bool:
    """transformers' own hook on the input embeddings."""
    if model is None:
        return False
    ckpt.unwrap(model).enable_input_require_grads()
    return True


def remove_input_hook(model: Any) -> None:
    """Take off the input hook a repair added, leaving the model as it was (transformers 4.x's
    `disable_input_require_grads` keeps the removed handle as an attribute); `model` may be a weak reference."""
    if isinstance(model, weakref.ref):
        model = model()
        if model is None:
            return
    base = ckpt.unwrap(model)
    base.disable_input_require_grads()
    base.__dict__.pop("_require_grads_hook", None)


WRITERS: dict[str, Callable[[Decision, Any, Any], bool]] = {
    "use_reentrant": _use_reentrant,
    probe.NEW_KWARGS: _legacy_kwargs_won,
    probe.OLD_KWARGS: _new_kwargs_won,
    probe.NEW_FLAG: _flag,
    "model.use_reentrant": _model_use_reentrant,
    "preserve_rng_state": _torch_keyword,
    "offload": _torch_keyword,
    "activation_offloading": _trl_offloading_off,
    "fsdp_activation_checkpointing": _fsdp_checkpointing_off,
    "checkpointing_kwargs.container": _kwargs_as_dict,
    "checkpointing_kwargs": _layer_kwargs_out,
    "checkpointing_kwargs.unknown": _unknown_keys_out,
    "inputs_require_grad": _input_hook,
}
"""The writer of each setting of `TARGETS` that has one: `write(decision, args, model)` carries out an applied decision
on the arguments and the live model and returns whether it did. A setting without one: nothing to write (a check, or
what the callback does step by step, `model.config.use_cache`)."""

UNDO: dict[str, Callable[[Any], None]] = {"inputs_require_grad": remove_input_hook}
"""What takes an applied write back off the live model when the run ends: `undo(model_ref)`."""
