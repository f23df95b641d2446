"""What the local tier knows about its entries beyond their bytes: size, compile time, hits, last use.

A SQLite database (stdlib ``sqlite3``) in WAL mode, shared by every process using the directory. Each
operation is one short transaction, so readers never wait on a compile. The entry files stay the truth:
the index is advisory and ``reconcile`` rebuilds it from them, so a lost or stale index only costs an
imprecise eviction order, never a wrong result.

Eviction value of an entry = (hits + 1) * compile seconds / size: what keeping it saves per byte (the +1
lets a new entry's compile time count before its first hit). Least valuable entries go first.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    size INTEGER NOT NULL,
    compile_seconds REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    digests TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value REAL NOT NULL);
"""


class Index:
    """The SQLite index of one cache directory."""

    def __init__(self, path: str | pathlib.Path, read_only: bool = False) -> None:
        self.path = pathlib.Path(path)
        self.read_only = read_only
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            if self.read_only:
                uri = f"file:{self.path}?mode=ro"
                connection = sqlite3.connect(uri, uri=True, timeout=5.0, check_same_thread=False)
            else:
                connection = sqlite3.connect(self.path, timeout=5.0, check_same_thread=False)
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute("PRAGMA synchronous=NORMAL")
                connection.executescript(_SCHEMA)
            connection.isolation_level = None  # explicit, short transactions
            self._connection = connection
        return self._connection

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            connection = self._connect()
            connection.execute("BEGIN IMMEDIATE")
            try:
                yield connection
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._connect().execute(sql, args).fetchall()
            except sqlite3.OperationalError:
                if self.read_only:
                    return []  # a read-only directory without an index yet
                raise

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    # -- writes (each a short transaction) --

    def record_put(self, key: str, kind: str, size: int, compile_seconds: float, digests: dict[str, str]) -> None:
        now = time.time()
        with self._transaction() as db:
            db.execute(
                "INSERT INTO entries(key, kind, size, compile_seconds, hits, created, last_used, digests) "
                "VALUES (?, ?, ?, ?, 0, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET size=excluded.size",
                (key, kind, size, compile_seconds, now, now, json.dumps(digests, sort_keys=True)),
            )

    def record_hit(self, key: str, saved_seconds: float, prefix: str = "") -> None:
        """Count a hit on ``key`` (counters ``hits`` and ``seconds_saved``, each with ``prefix``)."""
        with self._transaction() as db:
            db.execute("UPDATE entries SET hits = hits + 1, last_used = ? WHERE key = ?", (time.time(), key))
            _bump(db, prefix + "hits", 1)
            _bump(db, prefix + "seconds_saved", max(0.0, saved_seconds))

    def count(self, name: str, by: float = 1) -> None:
        """Add ``by`` to the counter ``name`` (misses, quarantined, evictions, remote_errors…)."""
        with self._transaction() as db:
            _bump(db, name, by)

    def remove(self, keys: list[str]) -> None:
        with self._transaction() as db:
            db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in keys])

    # -- reads --

    def rows(self) -> list[dict[str, Any]]:
        names = ("key", "kind", "size", "compile_seconds", "hits", "created", "last_used")
        rows = self._query(f"SELECT {', '.join(names)} FROM entries ORDER BY last_used DESC")
        return [dict(zip(names, row, strict=True)) for row in rows]

    def counters(self) -> dict[str, float]:
        return {name: value for name, value in self._query("SELECT name, value FROM counters")}

    def total_size(self) -> int:
        rows = self._query("SELECT COALESCE(SUM(size), 0) FROM entries")
        return int(rows[0][0]) if rows else 0

    def victims(self, max_bytes: int, keep: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
        """Keys (with sizes) to evict, least valuable first, until the total fits ``max_bytes``."""
        rows = self._query(
            "SELECT key, size FROM entries "
            "ORDER BY (hits + 1) * compile_seconds / MAX(size, 1) ASC, last_used ASC"
        )
        total = sum(size for _, size in rows)
        chosen = []
        for key, size in rows:
            if total <= max_bytes:
                break
            if key in keep:
                continue
            chosen.append((key, size))
            total -= size
        return chosen

    def nearest(self, kind: str, digests: dict[str, str], limit: int = 256) -> tuple[str, list[str]] | None:
        """The recent entry of ``kind`` whose component digests differ from ``digests`` in the fewest
        components, with their names (a cheap answer to "why did this miss?")."""
        best: tuple[str, list[str]] | None = None
        rows = self._query(
            "SELECT key, digests FROM entries WHERE kind = ? ORDER BY last_used DESC LIMIT ?", (kind, limit)
        )
        for key, text in rows:
            try:
                other = json.loads(text)
            except ValueError:
                continue
            differing = sorted(n for n in set(digests) | set(other) if digests.get(n) != other.get(n))
            if best is None or len(differing) < len(best[1]):
                best = (key, differing)
        return best


def _bump(db: sqlite3.Connection, name: str, by: float) -> None:
    db.execute(
        "INSERT INTO counters(name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
        (name, by, by),
    )
