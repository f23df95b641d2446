"""The persistent tiers behind the in-process one: local directory, then an optional remote store.

``get`` looks in the local directory, then the remote (a remote hit is written back locally), verifying
every entry it reads: a corrupt or mismatched entry is quarantined (local) or ignored (remote), counted,
and reported as a miss, so it is recompiled and never served. ``put`` publishes create-only to both tiers
and evicts the least valuable local entries past the size cap. ``claim`` is single-flight per key: across
threads and processes through the local directory (``flight.py``), then, with a remote tier, across hosts
through a lease in the remote store (``fleet.py``).

Modes: ``read-write``; ``read-only`` (never writes: no publish, no index updates); ``strict`` (reads and
writes like read-write; the caller refuses to compile); ``off`` (no persistent tier at all).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from tpucompile.cache.entry import CorruptEntryError, Entry, decode, encode, read_header
from tpucompile.cache.fleet import FleetClaims
from tpucompile.cache.flight import SingleFlight
from tpucompile.cache.index import Index
from tpucompile.cache.keys import component_digests
from tpucompile.cache.local import LocalStore
from tpucompile.cache.remote import GuardedRemote
from tpucompile.config import CACHE_MODES
from tpucompile.errors import TpuCompileWarning

log = logging.getLogger("tpucompile")

_index_failures_warned: set[tuple[str, str]] = set()
"""(index operation, error type) of each index failure this process has warned about: a broken or locked
index fails every call alike, and one warning per kind says as much as one per call."""



class PersistentCache:
    """Local directory + optional remote, with verification, quarantine, eviction and single-flight."""

    def __init__(
        self,
        root: str | pathlib.Path,
        mode: str = "read-write",
        remote: str | None = None,
        max_size: int | None = None,
        remote_timeout: float = 3.0,
        remote_lease: float = 60.0,
        remote_wait: float = 1800.0,
    ) -> None:
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
        self.mode = mode
        self.writable = mode in ("read-write", "strict")
        self.max_size = max_size
        self.local = LocalStore(root, create=self.writable)
        error = self.local.write_error() if self.writable else None
        if error is not None:  # once here, rather than a failed write (and a warning) per entry
            log.warning("tpucompile: cannot write the cache directory %s (%s); using it read-only", root, error)
            self.writable = False
        self.index = Index(self.local.base / "index.sqlite", read_only=not self.writable)
        self.remote = GuardedRemote(remote, remote_timeout) if remote else None
        self.flight = SingleFlight(self.local.locks if self.writable else None)
        # Only processes that publish take leases: others would make the fleet wait for nothing.
        self.fleet = FleetClaims(self.remote, remote_lease, remote_wait) if self.remote and self.writable else None
        self.quarantined = 0
        self._lock = threading.Lock()

    # -- reads --

    def get(self, key: str) -> tuple[Entry, str] | None:
        """The verified entry for ``key`` and the tier it came from ("local" or "remote"), or None."""
        data = self._read_local(key)
        if data is not None:
            try:
                return decode(data, key), "local"
            except CorruptEntryError as error:
                self.quarantine(key, str(error))
        if self.remote is None:
            return None
        data = self.remote.get(key)
        if data is None:
            return None
        try:
            entry = decode(data, key)
        except CorruptEntryError as error:
            log.warning("tpucompile: remote cache entry %s is corrupt (%s); ignoring it", key[:16], error)
            self._count("remote_corrupt")
            return None
        if self.writable:
            self.publish_local(entry, data)
        return entry, "remote"

    def _read_local(self, key: str) -> bytes | None:
        try:
            return self.local.read(key)
        except OSError as error:  # an unreadable file is treated like a corrupt one
            log.warning("tpucompile: cannot read cache entry %s: %s", key[:16], error)
            return None

    def contains(self, key: str) -> bool:
        """True when the local tier has an entry file for ``key`` (unverified; for waiters)."""
        return self.local.contains(key)

    # -- writes --

    def put(self, entry: Entry) -> None:
        """Publish ``entry`` locally and remotely (create-only); evict past the size cap."""
        if not self.writable:
            return
        data = encode(entry)
        self.publish_local(entry, data)
        if self.remote is not None:
            self.remote.put_if_absent(entry.key, data)

    def publish_local(self, entry: Entry, data: bytes) -> None:
        """Publish already encoded, verified bytes of ``entry`` in the local tier only."""
        try:
            published = self.local.publish(entry.key, data)
        except OSError as error:
            log.warning("tpucompile: cannot write the local cache (%s); continuing without it", error)
            return
        if published:
            self._index("record_put", entry.key, entry.kind, len(data), entry.compile_seconds,
                        component_digests(entry.components))
            if self.max_size is not None:
                self.prune(self.max_size, keep=frozenset([entry.key]))

    def record_hit(self, key: str, saved_seconds: float, kind: str = "executable") -> None:
        """Count a hit (executables in ``hits``, other kinds in ``<kind>_hits``) and the time it saved."""
        if self.writable:
            self._index("record_hit", key, saved_seconds, "" if kind == "executable" else f"{kind}_")

    def record_miss(self, kind: str = "executable") -> None:
        self._count("misses" if kind == "executable" else f"{kind}_misses")

    def quarantine(self, key: str, reason: str) -> None:
        """Move a bad local entry aside so it is never served again, and count it."""
        with self._lock:
            self.quarantined += 1
        log.warning("tpucompile: cache entry %s failed verification (%s); quarantined, recompiling", key[:16],
                    reason)
        if self.writable:
            self.local.quarantine(key, reason)
            self._index("remove", [key])
        self._count("quarantined")

    def prune(self, max_bytes: int, keep: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """Evict the least valuable entries until the local tier holds at most ``max_bytes``."""
        if not self.writable:
            return []
        with self._suppress("prune"):
            if self.index.total_size() <= max_bytes:
                return []
            victims = self.index.victims(max_bytes, keep)
            for key, _ in victims:
                self.local.delete(key)
            self.index.remove([key for key, _ in victims])
            self.index.count("evictions", len(victims))
            return victims
        return []

    def reconcile(self) -> dict[str, int]:
        """Make the index match the entry files: add rows for files it lacks, drop rows without files."""
        on_disk = set(self.local.list_keys())
        known = {row["key"] for row in self.index.rows()}
        added = 0
        for key in on_disk - known:
            head = self.local.read_head(key)
            size = self.local.size(key)
            if head is None or size is None:
                continue
            try:
                header = read_header(head)
            except CorruptEntryError:
                continue  # verify() will find it
            self.index.record_put(key, str(header.get("kind", "")), size, float(header.get("compile_seconds", 0)),
                                  dict(header.get("component_digests", {})))
            added += 1
        stale = sorted(known - on_disk)
        self.index.remove(stale)
        return {"added": added, "removed": len(stale), "temp_removed": self.local.clean_temp()}

    # -- single flight --

    @contextlib.contextmanager
    def claim(self, key: str) -> Iterator[bool]:
        """Single-flight for ``key``: this host's lock (``flight.py``), then the fleet's lease (``fleet.py``)
        unless the entry arrived meanwhile; a no-op lock when the cache cannot be written. Yields whether
        this caller holds both; the caller re-checks the cache either way."""
        with self.flight.claim(key, published=lambda: self.local.contains(key)) as held:
            if self.fleet is None or self.local.contains(key):
                yield held
            else:
                with self.fleet.claim(key, published=lambda: self._published_anywhere(key)) as leased:
                    yield held and leased

    def _published_anywhere(self, key: str) -> bool:
        """Whether an entry for ``key`` is in the local or the remote tier (unverified; for waiters)."""
        return self.local.contains(key) or (self.remote is not None and bool(self.remote.contains(key)))

    # -- introspection --

    def nearest(self, kind: str, components: dict[str, Any]) -> tuple[str, list[str]] | None:
        with self._suppress("nearest"):
            return self.index.nearest(kind, component_digests(components))
        return None

    def describe(self) -> dict[str, Any]:
        return {
            "dir": str(self.local.root),
            "mode": self.mode,
            "max_size": self.max_size,
            "remote": self.remote.describe() if self.remote else None,
            "fleet": self.fleet.describe() if self.fleet else None,
        }

    # -- helpers --

    def _index(self, method: str, *args: Any) -> None:
        with self._suppress(method):
            getattr(self.index, method)(*args)

    def _count(self, name: str) -> None:
        if self.writable:
            self._index("count", name)

    @contextlib.contextmanager
    def _suppress(self, operation: str) -> Iterator[None]:
        """The index is advisory: a locked or broken database must not fail a compile, but the user is told
        (once per process per operation and kind of error) that hits, evictions and ``tpucompile cache``
        statistics are off meanwhile."""
        try:
            yield
        except Exception as error:
            kind = (operation, type(error).__name__)
            log.debug("tpucompile: cache index operation %s failed: %s", operation, error)
            if kind not in _index_failures_warned:
                _index_failures_warned.add(kind)
                warnings.warn(f"tpucompile: cache index operation {operation!r} on {self.index.path} failed "
                              f"({type(error).__name__}: {error}); compiling goes on without it, but eviction and "
                              "cache statistics may be off (further failures of this kind are not reported)",
                              TpuCompileWarning, stacklevel=3)
