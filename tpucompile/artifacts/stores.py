"""The process-wide memory tiers and the persistent cache instances the layers share."""

from __future__ import annotations

import logging
import os
from typing import Any

from tpucompile.cache import MemoryStore, PersistentCache, default_root
from tpucompile.config import Options, parse_size

log = logging.getLogger("tpucompile")

executables: MemoryStore[Any] = MemoryStore(Options().executable_cache_size)
programs: MemoryStore[tuple[Any, str]] = MemoryStore(Options().executable_cache_size)
"""Lowered programs by key: (program, SHA-256 of its text without locations)."""
plans: MemoryStore[dict[str, Any]] = MemoryStore(Options().executable_cache_size)
host_op_choices: dict[tuple[str, int, str], tuple[str, ...]] = {}
"""The host-kernel choices of each program on each target, once per process (``executables``)."""
_caches: dict[tuple, PersistentCache | None] = {}


def persistent_cache(options: Options) -> PersistentCache | None:
    """The persistent tiers ``options`` ask for (one instance per distinct setting), None when off."""
    if options.cache_mode == "off":
        return None
    root = options.cache_dir or str(default_root())
    settings = (os.path.abspath(os.path.expanduser(root)), options.cache_mode, options.cache_remote,
                options.cache_max_size, options.cache_remote_timeout, options.cache_remote_lease,
                options.cache_remote_wait)
    if settings not in _caches:
        try:
            _caches[settings] = PersistentCache(
                settings[0],
                mode=options.cache_mode,
                remote=options.cache_remote,
                max_size=parse_size(options.cache_max_size) if options.cache_max_size else None,
                remote_timeout=float(options.cache_remote_timeout),
                remote_lease=options.cache_remote_lease,
                remote_wait=options.cache_remote_wait,
            )
        except OSError as error:
            log.warning("tpucompile: cannot use the cache directory %s (%s); caching in memory only", root, error)
            _caches[settings] = None
    return _caches[settings]


def open_caches() -> list[PersistentCache | None]:
    """The persistent caches this process has opened."""
    return list(_caches.values())


def held_by(options: Options) -> dict[str, Any]:
    """Who holds what a model puts in or finds in the memory tiers: its option set, which keeps at most its own
    ``executable_cache_size`` executables, programs and plans. A torch.compile option belongs to the model it is
    given for, so one model's small limit never drops another model's entries (models compiled with equal
    options share one bound)."""
    return {"group": options, "limit": options.executable_cache_size}


def executable_cache() -> MemoryStore[Any]:
    """The process-wide in-memory tier of loaded executables."""
    return executables


def clear_memory() -> None:
    """Forget every loaded executable, lowered program, plan and host-kernel choice of this process (tests,
    benchmarks)."""
    executables.clear()
    programs.clear()
    host_op_choices.clear()
    plans.clear()
