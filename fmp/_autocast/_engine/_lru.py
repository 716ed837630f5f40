"""A small thread-safe least-recently-used cache: the rewrite's memo tables (rewritten bodies, cast calls,
helper specialisations, producer maps) share it, so every one of them evicts and locks the same way.

A table keyed by an object's id (``of``) holds the object weakly where it can: what it learnt about a
program, a body or a closed-over array lasts while that object lives, and never keeps it alive. The
program autocast traces on each call is not reused by the next call, so it and everything the rewrite
learnt about it are freed when the call returns (with a strong entry it would stay in memory, and in every
later garbage collection's work, until hundreds of other entries evicted it).
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from typing import Any

_MISSING = object()


class _Strong:
    """The holder of an object that takes no weak reference: called, it returns the object."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class LRU:
    """``get``/``put`` under one lock; the least recently used entry goes first past ``size`` entries."""

    def __init__(self, size: int = 1024):
        self._data: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()
        self._dead: list[Any] = []  # keys whose object died (appended by weak-reference callbacks)

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            if self._dead:
                self._purge()
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._data.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> Any:
        """Stores ``value`` under ``key``; returns it."""
        with self._lock:
            self._purge()
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)
        return value

    def of(self, obj: Any, key: Any, make: Callable[[], Any]) -> Any:
        """The value cached for ``obj`` under ``key`` (``id(obj)`` and whatever else decides it), else
        ``make()``, stored. The entry refers to ``obj`` weakly where ``obj`` allows it and is dropped when
        ``obj`` dies (an object without weak references is held); an entry whose object is another (an id
        reused) is made again. The value must not refer to ``obj`` itself, or ``obj`` would never die."""
        value = self.cached(obj, key, _MISSING)
        if value is not _MISSING:
            return value
        value = make()
        try:
            ref: Callable[[], Any] = weakref.ref(obj, self._forget(key))
        except TypeError:
            ref = _Strong(obj)
        self.put(key, (ref, value))
        return value

    def cached(self, obj: Any, key: Any, default: Any = None) -> Any:
        """The value ``of`` stored for ``obj`` under ``key``, else ``default`` (nothing is made)."""
        hit = self.get(key)
        return hit[1] if hit is not None and hit[0]() is obj else default

    def _forget(self, key: Any) -> Callable[[Any], None]:
        def died(ref: Any) -> None:
            # may run inside any code of this thread (when the last reference drops) or of the collector:
            # only a list append here (atomic); the entry goes now if the lock is free, else at the next use
            self._dead.append((key, ref))
            if self._lock.acquire(blocking=False):
                try:
                    self._purge()
                finally:
                    self._lock.release()

        return died

    def _purge(self) -> None:  # under the lock
        while self._dead:
            key, ref = self._dead.pop()
            entry = self._data.get(key)
            if entry is not None and entry[0] is ref:  # not a newer entry under a reused id
                del self._data[key]

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._dead.clear()

    def __len__(self) -> int:
        with self._lock:
            self._purge()
            return len(self._data)
