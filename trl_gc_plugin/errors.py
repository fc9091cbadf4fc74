"""Exceptions raised by trl_gc_plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .decisions import Decision


class GCConfigError(ValueError):
    """A gradient-checkpointing configuration that is known to break training.

    Raised in `strict` mode before the first training step. The message names each rule that failed, the setting
    to change and the evidence; `decisions` holds the structured records.

    Args:
        message (`str`): the human-readable explanation.
        decisions (`list[Decision]`, *optional*): the `error` decisions behind it.
    """

    def __init__(self, message: str, decisions: list[Decision] | None = None) -> None:
        super().__init__(message)
        self.decisions: list[Decision] = list(decisions or [])
