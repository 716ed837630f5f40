"""A small thread-safe least-recently-used cache: the rewrite's memo tables (rewritten bodies, cast calls,
helper specialisations, producer maps) share it, so every one of them evicts and locks the same way."""

from __future__ import annotations

import collections
import threading
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

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
