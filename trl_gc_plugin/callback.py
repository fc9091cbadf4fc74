"""`SafeGCCallback`: decides, fixes and verifies gradient checkpointing for one Trainer."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from . import probe
from .apply import apply, restore_use_cache
from .decisions import Decision, is_main_process, log_decisions, write_decisions
from .engine import decide, final_use_reentrant
from .modes import Mode, resolve_mode
from .patching import raise_for_errors

logger = logging.getLogger("trl_gc_plugin")

_CLAIM = "_trl_gc_plugin_owner"


class SafeGCCallback(TrainerCallback):
    """A [`~transformers.TrainerCallback`] that makes gradient checkpointing safe for the run it is attached to.

    At `on_init_end` it reads the arguments and the model, decides `use_reentrant` with the rule table
    (`trl_gc_plugin.RULES`), validates the combination, writes the decision into the arguments (both the
    `activation_checkpointing*` and the deprecated `gradient_checkpointing*` names, as one object) and into a
    model that already checkpoints, and logs every decision. `on_train_begin`, once the Trainer has enabled
    checkpointing, verifies the live model runs what was decided and repairs it if not. `on_train_end` restores
    what it changed on the model config.

    Args:
        mode (`str`, *optional*):
            `"strict"` (default): fill unset values, repair upstream inconsistencies, raise `GCConfigError` before
            the first step for an explicit choice known to break training. `"fix"`: as strict, but override such a
            choice with a loud warning. `"warn"`: change nothing, log what strict/fix would do.
            `None` reads `TRL_GC_PLUGIN_MODE`.
        write_json (`bool`, *optional*, defaults to `True`):
            Write the decisions to `<output_dir>/gc_decisions.json` (main process only).

    Environment:
        TRL_GC_PLUGIN_MODE: the mode when `mode` is None.

    Attributes:
        decisions (`list[Decision]`): the decisions for the last Trainer this callback saw, the ones taken when
            its arguments were built (with `install()`) first.

    Example:
        ```python
        from trl import SFTConfig, SFTTrainer
        from trl_gc_plugin import SafeGCCallback

        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(output_dir="out", gradient_checkpointing=True),
            train_dataset=dataset,
            callbacks=[SafeGCCallback()],
        )
        ```
    """

    auto_registered = False

    def __init__(self, mode: str | None = None, write_json: bool = True) -> None:
        self.mode: Mode = resolve_mode(mode)
        self.write_json = write_json
        self.decisions: list[Decision] = []
        self._active = False
        self._final: tuple[Any, str] = (None, "unset")

    # --- events ------------------------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        owner = state.__dict__.get(_CLAIM)
        if owner is not None and owner is not self:
            self._become_passive(owner)
            return
        state.__dict__[_CLAIM] = self
        self._active = True
        if model is None:
            return
        facts = probe.facts_from_trainer(args, model, stage="init_end")
        decisions = decide(facts, self.mode)
        record = probe.get_record(args)
        self.decisions = (list(record.decisions) if record is not None else []) + decisions
        self._refuse(args, decisions)
        apply(decisions, args, model)
        self._final = final_use_reentrant(decisions, facts.use_reentrant, facts.use_reentrant_source)
        probe.remember(args, *self._final)
        self._publish(args, decisions)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Checkpointing is live now: check the model runs what was decided; repair it when it does not."""
        if not self._active or model is None:
            return
        facts = probe.facts_from_trainer(args, model, stage="train")
        decisions = [d for d in decide(facts, self.mode) if d.action != "none"]
        if not decisions:
            return
        self.decisions.extend(decisions)
        self._refuse(args, decisions)
        apply(decisions, args, model)
        self._final = final_use_reentrant(decisions, *self._final)
        probe.remember(args, *self._final)
        self._publish(args, decisions)

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self._active and model is not None and restore_use_cache(model):
            logger.debug("model.config.use_cache restored")

    # --- helpers -----------------------------------------------------------------------------------------------

    def _publish(self, args: Any, new: list[Decision]) -> None:
        main = is_main_process(args)
        log_decisions(new, main)
        if main and self.write_json:
            write_decisions(self.decisions, getattr(args, "output_dir", None))

    def _refuse(self, args: Any, decisions: list[Decision]) -> None:
        """Before anything is applied: in strict/fix mode, log and raise for `error` decisions."""
        if self.mode != "warn" and any(d.action == "error" for d in decisions):
            self._publish(args, decisions)
            raise_for_errors(decisions, self.mode)

    def _become_passive(self, owner: SafeGCCallback) -> None:
        """Registered twice (explicitly and through TRL_GC_PLUGIN / install()): the first instance acts."""
        self._active = False
        self.decisions = owner.decisions
        if owner.mode != self.mode:
            logger.warning(
                "SafeGCCallback is registered twice for this Trainer; the first one (mode=%s) acts, this one "
                "(mode=%s) stands by. Set TRL_GC_PLUGIN_MODE=%s, or drop one of the registrations.",
                owner.mode,
                self.mode,
                self.mode,
            )


class AutoSafeGCCallback(SafeGCCallback):
    """The class `install()` and `TRL_GC_PLUGIN=1` put in `transformers.trainer.DEFAULT_CALLBACKS`."""

    auto_registered = True
