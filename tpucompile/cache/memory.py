"""The in-process tier: loaded executables by key, least recently used dropped first.

Deserialising or recompiling an executable costs milliseconds to seconds; keeping loaded ones here makes a
second ``torch.compile`` of the same model in one process free.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class MemoryStore(Generic[V]):
    """A thread-safe LRU map from key to value, bounded per group of users.

    Each entry is held by the groups that put or found it (the option sets of the models compiled in this
    process), and each group keeps at most its own ``limit`` entries, its least recently used dropped first:
    a model compiled with a small limit only ever drops its own entries, never another model's. An entry that
    no group holds any more is forgotten. Calls without a group share the default group, bounded by
    ``capacity``.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.stats = CacheStats()
        self._entries: dict[str, V] = {}
        self._groups: dict[Hashable, collections.OrderedDict[str, None]] = {}
        self._holders: dict[str, set[Hashable]] = {}
        self._lock = threading.Lock()

    def get(self, key: str, group: Hashable = None, limit: int | None = None) -> V | None:
        """The value under ``key``, which ``group`` (bounded by ``limit``) now holds too; None when absent."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self._hold(key, group, limit)
            self.stats.hits += 1
            return value

    def put(self, key: str, value: V, group: Hashable = None, limit: int | None = None) -> None:
        """Keep ``value`` under ``key`` for ``group``, which then keeps at most ``limit`` entries (``capacity``
        when None)."""
        with self._lock:
            self._entries[key] = value
            self._hold(key, group, limit)

    def resize(self, capacity: int) -> None:
        """Bound the default group (calls without a group) by ``capacity``."""
        with self._lock:
            self.capacity = max(1, capacity)
            self._trim(None, self.capacity)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._groups.clear()
            self._holders.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def _hold(self, key: str, group: Hashable, limit: int | None) -> None:
        order = self._groups.setdefault(group, collections.OrderedDict())
        order[key] = None
        order.move_to_end(key)
        self._holders.setdefault(key, set()).add(group)
        self._trim(group, self.capacity if limit is None else max(1, limit))

    def _trim(self, group: Hashable, limit: int) -> None:
        order = self._groups.get(group)
        while order is not None and len(order) > limit:
            dropped, _ = order.popitem(last=False)
            holders = self._holders[dropped]
            holders.discard(group)
            if not holders:
                del self._holders[dropped]
                del self._entries[dropped]
                self.stats.evictions += 1
