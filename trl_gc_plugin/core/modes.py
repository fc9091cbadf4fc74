"""The plugin's modes (stdlib only). How a mode is chosen (argument > `install()` > `$TRL_GC_PLUGIN_MODE` > strict) is
the settings layer's (`settings.py`), for every route."""

from __future__ import annotations

from typing import Literal

Mode = Literal["strict", "fix", "warn"]
MODES: tuple[Mode, ...] = ("strict", "fix", "warn")
