"""This process's compile figures added to the counters of the persistent caches it used, at exit, so that
``tpucompile cache stats`` shows them summed over every process that shared a cache (``tpucompile.stats()``
shows one process's, per graph)."""

from __future__ import annotations

import atexit
import logging
import sqlite3

from tpucompile.artifacts import stores
from tpucompile.metrics import compile_stats

log = logging.getLogger("tpucompile")

COUNTERS = ("graph_compiles", "recompiles", "bucket_hits")
"""The index counters this adds to: executables compiled (not taken from a cache), compiles for a new size or
bucket of a graph that had one, and calls served by a bucket's executable compiled before."""

_registered = False


def record_at_exit() -> None:
    """Add this process's figures to its caches' counters when it exits (registered once)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(flush)


def flush() -> None:
    """Add the figures gathered since the last flush to every writable persistent cache this process opened."""
    total = compile_stats.snapshot()["total"]
    figures = {"graph_compiles": total["compiles"], "recompiles": total["recompiles"],
               "bucket_hits": total["bucket_hits"]}
    if not any(figures.values()):
        return
    for cache in list(stores.open_caches()):
        if cache is None or not cache.writable:
            continue
        try:
            for name, value in figures.items():
                if value:
                    cache.index.count(name, value)
        except (OSError, sqlite3.Error) as error:  # figures only: never fail the user's exit over them
            log.warning("tpucompile: compile figures not added to the cache index: %s", error)
    compile_stats.reset()
