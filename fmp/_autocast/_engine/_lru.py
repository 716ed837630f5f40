"""A small thread-safe least-recently-used cache: the rewrite's memo tables (rewritten bodies, cast calls,
helper specialisations, producer maps) share it, so every one of them evicts and locks the same way."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

_MISSING = object()


class LRU:
    """``get``/``put`` under one lock; the least recently used entry goes first past ``size`` entries."""

    def __init__(self, size: int = 1024):
        self._data: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._data.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> Any:
        """Stores ``value`` under ``key``; returns it."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)
        return value

    def of(self, obj: Any, key: Any, make: Callable[[], Any]) -> Any:
        """The value cached for ``obj`` under ``key`` (``id(obj)`` and whatever else decides it), else
        ``make()``, stored. The entry holds ``obj``, so its id is not reused while cached, and an entry
        whose object is another (an id reused after eviction) is made again."""
        hit = self.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        return self.put(key, (obj, make()))[1]

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
