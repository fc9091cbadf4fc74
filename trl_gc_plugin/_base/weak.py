"""Memory about users' objects, kept outside them.

The plugin remembers things about `TrainingArguments` (who set `use_reentrant`) and `TrainerState` (which callback
acts for a Trainer). Storing them on those objects would put them into what users save and share: the Trainer
pickles the arguments into every checkpoint's `training_args.bin`, and a pickle that names a `trl_gc_plugin` class
cannot be loaded where the plugin is not installed. So they live here, keyed by object identity, and an entry goes
away with its object (a weak reference's callback), so a recycled `id()` never finds a stale entry.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class WeakIdMap(Generic[V]):
    """A map from live objects (by identity, hashable or not) to values; nothing is written on the objects.

    Objects that do not support weak references are not remembered (`get` returns None for them).
    """

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref[Any], V]] = {}

    def get(self, obj: Any) -> V | None:
        item = self._data.get(id(obj))
        if item is None or item[0]() is not obj:
            return None
        return item[1]

    def set(self, obj: Any, value: V) -> None:
        key = id(obj)
        data = self._data
        try:
            ref = weakref.ref(obj, lambda _ref, key=key: data.pop(key, None))
        except TypeError:  # no __weakref__ slot: do not remember
            return
        data[key] = (ref, value)

    def pop(self, obj: Any) -> V | None:
        value = self.get(obj)
        if value is not None:
            del self._data[id(obj)]
        return value

    def __len__(self) -> int:
        return len(self._data)

    def values(self) -> list[V]:
        """The values of the objects still alive."""
        return [value for ref, value in list(self._data.values()) if ref() is not None]
