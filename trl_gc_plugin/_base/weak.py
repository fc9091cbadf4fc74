"""Memory about users' objects, kept outside them: on the `TrainingArguments` it would be pickled into every
checkpoint's `training_args.bin`, which then would not load without the plugin. Keyed by identity; an entry goes with
its object, so a recycled `id()` never finds a stale one.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class WeakIdMap(Generic[V]):
    """A map from live objects (by identity, hashable or not) to values; objects without weak references are not
    remembered."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref[Any], V]] = {}

    def get(self, obj: Any) -> V | None:
        item = self._data.get(id(obj))
        return item[1] if item is not None and item[0]() is obj else None

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

    def values(self) -> list[V]:
        return [value for ref, value in list(self._data.values()) if ref() is not None]
