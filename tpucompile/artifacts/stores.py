"""The process-wide memory tiers and the persistent cache instances the layers share."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, TypeVar

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
V = TypeVar("V")


@dataclasses.dataclass(frozen=True)
class ArtifactTiers:
    """Where the artifacts of one option set live, resolved from its options once per compile: its share of the
    process's memory tiers and the persistent cache the options name.

    A torch.compile option belongs to the model it is given for, so the memory tiers hold a model's entries
    for its option set, which keeps at most its own ``executable_cache_size`` executables, programs and plans:
    one model's small limit never drops another model's entries (equal options share one bound)."""

    option_set: Options
    """The options these tiers were resolved from: what makes two option sets' tiers equal."""
    persistent: PersistentCache | None
    """The local directory and remote, None when ``cache_mode`` is "off" (or the directory is unusable)."""

    @property
    def limit(self) -> int:
        """How many executables, programs and plans this option set keeps in each memory tier."""
        return self.option_set.executable_cache_size

    @property
    def strict(self) -> bool:
        """Whether a missing executable is an error (``cache_mode="strict"``) instead of compiled now."""
        return self.option_set.cache_mode == "strict"

    def get(self, store: MemoryStore[V], key: str) -> V | None:
        """The value ``store`` keeps under ``key``, now held by this option set too; None when absent."""
        return store.get(key, group=self, limit=self.limit)

    def put(self, store: MemoryStore[V], key: str, value: V) -> None:
        """Keep ``value`` in ``store`` under ``key`` for this option set."""
        store.put(key, value, group=self, limit=self.limit)


def artifact_tiers(options: Options) -> ArtifactTiers:
    """The tiers a compile with ``options`` finds and keeps its artifacts in."""
    return ArtifactTiers(options, persistent_cache(options))


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
