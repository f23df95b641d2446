"""The in-process tier: loaded executables by key, least recently used dropped first.

Deserialising or recompiling an executable costs milliseconds to seconds; keeping loaded ones here makes a
second ``torch.compile`` of the same model in one process free.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class MemoryStore(Generic[V]):
    """A thread-safe LRU map from key to value with a bounded number of entries."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.stats = CacheStats()
        self._entries: collections.OrderedDict[str, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return value

    def put(self, key: str, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.stats.evictions += 1

    def resize(self, capacity: int) -> None:
        with self._lock:
            self.capacity = max(1, capacity)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries
