"""Single-flight: when several threads or processes need the same missing key, one compiles, the rest wait.

In a process, each key has a lock that the first thread takes; the others block on it and then find the
result in the cache. Across processes, the holder takes an OS file lock (``filelock``: ``flock`` on POSIX,
released by the kernel when the holder dies, even by SIGKILL) and writes a lease file next to it with its
pid, host and expiry. A waiter stops waiting and compiles itself when the holder is gone: its lock was
released without a published entry, its pid no longer exists on this host, or its lease expired (a holder
that hangs, or a filesystem where the lock is only advisory). Waiting is never unbounded.

Callers check the cache before claiming (no lock on the hit path) and again after (someone may have
published while they waited).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import filelock

from tpucompile.cache.keys import is_key


class SingleFlight:
    """Per-key claims: in-process locks, plus lock files under ``lock_dir`` when given."""

    def __init__(self, lock_dir: pathlib.Path | None, lease_seconds: float = 600.0, poll: float = 0.05) -> None:
        self.lock_dir = lock_dir
        self.lease_seconds = lease_seconds
        self.poll = poll
        self._locks: dict[str, threading.Lock] = {}
        self._users: dict[str, int] = {}
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def claim(self, key: str, published: Callable[[], bool] = lambda: False) -> Iterator[bool]:
        """Hold ``key`` while compiling it. Yields True when this caller holds the cross-process lock, False
        when it stopped waiting (``published()`` turned true, or the holder is stale) and should re-check
        the cache and compile without it."""
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        with self._local_lock(key):
            if self.lock_dir is None:
                yield True
                return
            lock = filelock.FileLock(str(self.lock_dir / f"{key}.lock"))
            held = self._acquire(lock, key, published)
            try:
                if held:
                    self._write_lease(key)
                yield held
            finally:
                if held:
                    with contextlib.suppress(OSError):
                        (self.lock_dir / f"{key}.lease").unlink()
                    lock.release()

    @contextlib.contextmanager
    def _local_lock(self, key: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
            self._users[key] = self._users.get(key, 0) + 1
        try:
            with lock:
                yield
        finally:
            with self._guard:
                self._users[key] -= 1
                if not self._users[key]:
                    del self._users[key]
                    del self._locks[key]

    def _acquire(self, lock: filelock.FileLock, key: str, published: Callable[[], bool]) -> bool:
        while True:
            try:
                lock.acquire(timeout=self.poll * 4, poll_interval=self.poll)
                return True
            except filelock.Timeout:
                pass
            except OSError:  # no lock file can be made (the folder became read-only, a full disk): compile
                return False  # without the cross-process lock; at worst another process compiles the key too
            if published() or self._holder_is_stale(key):
                return False

    def _write_lease(self, key: str) -> None:
        assert self.lock_dir is not None
        now = time.time()
        lease = {"pid": os.getpid(), "host": socket.gethostname(), "started": now,
                 "expires": now + self.lease_seconds}
        path = self.lock_dir / f"{key}.lease"
        temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            temp.write_text(json.dumps(lease))
            os.replace(temp, path)
        except OSError:  # a full disk: no lease (waiters rely on the lock), and no half-written temp file
            with contextlib.suppress(OSError):
                temp.unlink()

    def _holder_is_stale(self, key: str) -> bool:
        assert self.lock_dir is not None
        try:
            lease = json.loads((self.lock_dir / f"{key}.lease").read_text())
        except (OSError, ValueError):
            return False  # no lease yet: the holder is between taking the lock and writing it
        if time.time() > float(lease.get("expires", 0)):
            return True
        if lease.get("host") == socket.gethostname():
            return not _pid_alive(int(lease.get("pid", 0)))
        return False


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
