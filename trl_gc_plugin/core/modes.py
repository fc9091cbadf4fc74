"""The plugin's modes (chosen in `settings.py`)."""

from __future__ import annotations

from typing import Literal

Mode = Literal["strict", "fix", "warn"]
MODES: tuple[Mode, ...] = ("strict", "fix", "warn")
