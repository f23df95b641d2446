"""What this process compiled and reused, per graph: the figures behind ``tpucompile.stats()``.

A graph's executables come from a compile, or from a cache tier (``memory``, ``local``, ``remote``); a graph
with symbolic sizes compiles again for a new size or bucket (each recompile keeps its reason), and a bucketed
graph counts the calls that an executable it had already compiled served.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any


@dataclasses.dataclass
class GraphStats:
    compiles: int = 0
    hits: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    recompiles: list[str] = dataclasses.field(default_factory=list)
    bucket_hits: int = 0
    stack_copies: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"compiles": self.compiles, "hits": dict(self.hits), "recompiles": list(self.recompiles),
                "bucket_hits": self.bucket_hits, "stack_copies": self.stack_copies}


_graphs: dict[str, GraphStats] = {}
_lock = threading.Lock()


def _graph(name: str) -> GraphStats:
    found = _graphs.get(name)
    if found is None:
        with _lock:
            found = _graphs.setdefault(name, GraphStats())
    return found


def record_executable(name: str, tier: str | None) -> None:
    """One executable of graph ``name`` obtained: compiled now (``tier`` None) or from a cache tier."""
    stats = _graph(name)
    if tier is None:
        stats.compiles += 1
    else:
        stats.hits[tier] += 1


def record_recompile(name: str, reason: str) -> None:
    _graph(name).recompiles.append(reason)


def record_bucket_hit(name: str) -> None:
    _graph(name).bucket_hits += 1


def record_stack_copy(name: str) -> None:
    """A call of graph ``name`` stacked one of its rolled layers' parameters by copy, not reading the buffer
    they are views of (its first call, or one after their ``.data`` was replaced)."""
    _graph(name).stack_copies += 1


def snapshot() -> dict[str, Any]:
    """Per graph and in total: executables compiled, cache hits by tier, recompiles with their reasons, bucket
    hits (calls served by the executable of a bucket compiled before) and stack copies (``record_stack_copy``)."""
    graphs = {name: stats.as_dict() for name, stats in list(_graphs.items())}
    hits: collections.Counter = collections.Counter()
    for stats in graphs.values():
        hits.update(stats["hits"])
    total = {"compiles": sum(s["compiles"] for s in graphs.values()), "hits": dict(hits),
             "recompiles": sum(len(s["recompiles"]) for s in graphs.values()),
             "bucket_hits": sum(s["bucket_hits"] for s in graphs.values()),
             "stack_copies": sum(s["stack_copies"] for s in graphs.values())}
    return {"total": total, "graphs": graphs}


def reset() -> None:
    """Forget every figure (a benchmark or test measuring one phase)."""
    with _lock:
        _graphs.clear()
