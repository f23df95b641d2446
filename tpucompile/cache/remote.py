"""The optional shared tier: any fsspec URL, or Redis.

Remote stores are a convenience, never a dependency of a compile: every call goes through ``GuardedRemote``,
which bounds it with a timeout, turns any error into "not there", logs the first failure once, and skips
the remote for a cool-down period afterwards, so a dead network costs one timeout, not one per graph.
Writes are create-only (Redis ``SET NX``; for fsspec, a temp object moved into place if none exists).
Each store also keeps leases (``remote_lease.py``), with which hosts agree on who compiles a key.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from tpucompile.cache.keys import is_key
from tpucompile.cache.remote_lease import FsspecLeases, Holder, RedisLeases

log = logging.getLogger("tpucompile")
T = TypeVar("T")


class RemoteStore(Protocol):
    """Bytes by key on some shared service."""

    url: str
    leases: RedisLeases | FsspecLeases

    def get(self, key: str) -> bytes | None: ...

    def put_if_absent(self, key: str, data: bytes) -> bool: ...

    def contains(self, key: str) -> bool: ...


class FsspecStore:
    """Entries as objects under an fsspec URL (``file:///shared/cache``, ``memory://cache``, ``s3://…``)."""

    def __init__(self, url: str, timeout: float) -> None:
        import fsspec

        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        self.timeout = timeout
        self.leases = FsspecLeases(self.fs, self.root)

    def _path(self, key: str) -> str:
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        return f"{self.root}/v1/{key[:2]}/{key}"

    def get(self, key: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if self.fs.exists(path):
            return False
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        self.fs.pipe_file(temp, data)
        if self.fs.exists(path):
            self.fs.rm_file(temp)
            return False
        self.fs.mv(temp, path)
        return True


class RedisStore:
    """Entries as Redis strings ``tpucompile:v1:<key>`` (``redis://host:port/db``), written with SET NX."""

    def __init__(self, url: str, timeout: float) -> None:
        import redis

        self.url = url
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False
        )
        self.leases = RedisLeases(self.client)

    @staticmethod
    def _name(key: str) -> str:
        if not is_key(key):
            raise ValueError(f"not a cache key: {key!r}")
        return f"tpucompile:v1:{key}"

    def get(self, key: str) -> bytes | None:
        return self.client.get(self._name(key))

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(self._name(key)))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return bool(self.client.set(self._name(key), data, nx=True))


def open_remote(url: str, timeout: float) -> RemoteStore:
    """The store for ``url``: Redis for ``redis://``/``rediss://``/``unix://``, fsspec for anything else."""
    if url.split("://", 1)[0] in ("redis", "rediss", "unix"):
        return RedisStore(url, timeout)
    return FsspecStore(url, timeout)


class GuardedRemote:
    """A remote store whose failures and slowness never reach the compile that uses it."""

    def __init__(self, url: str, timeout: float = 3.0, cooldown: float = 30.0,
                 opener: Callable[[str, float], RemoteStore] = open_remote) -> None:
        self.url = url
        self.timeout = timeout
        self.cooldown = cooldown
        self.errors = 0
        self._opener = opener
        self._store: RemoteStore | None = None
        self._down_until = 0.0
        self._down_since = float("-inf")
        self._logged = False
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def get(self, key: str) -> bytes | None:
        return self._call("get", lambda store: store.get(key))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return bool(self._call("put", lambda store: store.put_if_absent(key, data)))

    def contains(self, key: str) -> bool | None:
        """Whether an entry for ``key`` is there (unverified); None when the remote did not answer."""
        return self._call("contains", lambda store: store.contains(key))

    def take_lease(self, key: str, holder: Holder, seconds: float) -> dict[str, Any] | None:
        """The lease record in force after trying to take ``key``'s lease (``holder``'s own when taken, ``{}``
        when another's cannot be read); None when the remote did not answer."""
        return self._call("lease", lambda store: store.leases.take(key, holder, seconds))

    def renew_lease(self, key: str, holder: Holder, seconds: float) -> bool | None:
        """Whether ``holder`` still held the lease and extended it; None when the remote did not answer."""
        return self._call("lease renewal", lambda store: store.leases.renew(key, holder, seconds))

    def release_lease(self, key: str, holder: Holder) -> bool | None:
        return self._call("lease release", lambda store: store.leases.release(key, holder))

    def _call(self, what: str, action: Callable[[RemoteStore], T]) -> T | None:
        if not self.available:
            return None
        started = time.monotonic()
        try:
            store = self._open()  # importing the client library is not the network's time
        except Exception as error:
            self._failed(what, error, started)
            return None
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append((True, action(store)))
            except BaseException as error:
                outcome.append((False, error))

        # A daemon thread per call, not a pool: a call that never returns must not keep the process from
        # exiting (pool workers are joined at exit).
        worker = threading.Thread(target=run, name="tpucompile-remote", daemon=True)
        worker.start()
        worker.join(self.timeout + 0.5)
        if not outcome:
            self._failed(what, TimeoutError(f"no answer within {self.timeout:g}s"), started)
            return None
        ok, value = outcome[0]
        if not ok:
            self._failed(what, value, started)
            return None
        return value

    def _open(self) -> RemoteStore:
        with self._lock:
            if self._store is None:
                self._store = self._opener(self.url, self.timeout)
            return self._store

    def _failed(self, what: str, error: BaseException, started: float) -> None:
        """Skip the remote for the cool-down. Calls that were in flight together (a lease renewal and a
        lookup) fail together: only the first to give up counts, as one outage costs one timeout."""
        with self._lock:
            if self._down_since >= started:
                return
            self._down_since = time.monotonic()
            self._down_until = self._down_since + self.cooldown
            self.errors += 1
        if not self._logged:
            self._logged = True
            log.warning(
                "tpucompile: remote cache %s failed (%s: %s); continuing with the local cache "
                "(the remote is retried every %.0fs)", self.url, type(error).__name__, error, self.cooldown
            )
        else:
            log.debug("tpucompile: remote cache %s %s failed again: %s", self.url, what, error)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "errors": self.errors, "available": self.available}
