"""Leases in the remote store: which host of a fleet compiles a key while the others wait for its entry.

A lease is a small JSON record: the holder's token (unique per claim), host and pid, and when it expires.
Only its holder renews or releases it; anyone may take it once it has expired. A lease only saves work: two
hosts that both believe they hold one compile the same key twice and publish equal, create-only entries, so
every rule below errs towards "take it" over "wait forever".

Redis: one string per key, taken with ``SET NX PX`` inside a script that also replaces a value this code did
not write (garbage, or a string without expiry, which would otherwise block the key for good); the server
expires it, so hosts' clocks do not matter. Renewal and release compare the token first (atomic scripts).

fsspec: object stores have create-only writes but no compare-and-swap, so a key's lease is a series of
generations, ``<root>/v1/leases/<key>/<n>``, the highest being in force. Taking a free key creates the next
generation create-only; taking over an expired one creates generation n+1, so of several hosts taking over
the same expired lease exactly one succeeds (the others find the object there); the winner deletes the older
generations. Renewal rewrites the holder's own generation, release deletes it. The expiry is the holder's
wall clock: hosts' clocks must agree to well within a lease. A generation that cannot be parsed (being
written, or garbage) counts as held until this process has seen it unreadable for a whole lease.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import uuid
from typing import Any

from tpucompile.cache.keys import is_key


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who takes a lease: a token unique to one claim, and the host and pid for people reading it."""

    token: str
    host: str
    pid: int

    def record(self, seconds: float) -> dict[str, Any]:
        now = time.time()
        return {"token": self.token, "host": self.host, "pid": self.pid, "taken": now, "expires": now + seconds}


def parse_record(data: bytes | str | None) -> dict[str, Any] | None:
    """The lease record in ``data``, or None when it is not one this code wrote."""
    if data is None:
        return None
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("token"), str):
        return None
    expires = record.get("expires")
    if not isinstance(expires, (int, float)) or isinstance(expires, bool) or not math.isfinite(expires):
        return None
    return record


def _lease_key(key: str) -> str:
    if not is_key(key):
        raise ValueError(f"not a cache key: {key!r}")
    return key


_TAKE = """
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return ARGV[1] end
local current = redis.call('get', KEYS[1])
local ok, lease = pcall(cjson.decode, current)
if (not ok) or type(lease) ~= 'table' or type(lease['token']) ~= 'string' or redis.call('pttl', KEYS[1]) < 0 then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return current
"""
_IF_HOLDER = """
local current = redis.call('get', KEYS[1])
if not current then return 0 end
local ok, lease = pcall(cjson.decode, current)
if (not ok) or type(lease) ~= 'table' or lease['token'] ~= ARGV[1] then return 0 end
"""
_RENEW = _IF_HOLDER + "redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])\nreturn 1\n"
_RELEASE = _IF_HOLDER + "redis.call('del', KEYS[1])\nreturn 1\n"


class RedisLeases:
    """Leases as Redis strings ``tpucompile:v1:lease:<key>`` that the server expires."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @staticmethod
    def _name(key: str) -> str:
        return f"tpucompile:v1:lease:{_lease_key(key)}"

    def take(self, key: str, holder: Holder, seconds: float) -> dict[str, Any]:
        """The record in force after trying to take the lease: ``holder``'s own when it got it; ``{}`` when
        another holder's value cannot be read."""
        mine = json.dumps(holder.record(seconds))
        current = self.client.eval(_TAKE, 1, self._name(key), mine, _milliseconds(seconds))
        return parse_record(current) or {}

    def renew(self, key: str, holder: Holder, seconds: float) -> bool:
        record = json.dumps(holder.record(seconds))
        return bool(self.client.eval(_RENEW, 1, self._name(key), holder.token, record, _milliseconds(seconds)))

    def release(self, key: str, holder: Holder) -> bool:
        return bool(self.client.eval(_RELEASE, 1, self._name(key), holder.token))


def _milliseconds(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class FsspecLeases:
    """Leases as generations of create-only objects under ``<root>/v1/leases/<key>/``."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = root
        self._unreadable_since: dict[str, float] = {}

    def _folder(self, key: str) -> str:
        return f"{self.root}/v1/leases/{_lease_key(key)}"

    def _generations(self, key: str) -> list[int]:
        folder = self._folder(key)
        self.fs.invalidate_cache(folder)
        try:
            names = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        last_parts = (name.rstrip("/").rsplit("/", 1)[-1] for name in names)
        return sorted(int(part) for part in last_parts if part.isascii() and part.isdigit())

    def _read(self, path: str) -> dict[str, Any] | None:
        """The record at ``path``; None when there is none; ``{}`` when it cannot be parsed."""
        try:
            return parse_record(self.fs.cat_file(path)) or {}
        except FileNotFoundError:
            return None

    def _in_force(self, path: str, record: dict[str, Any], seconds: float) -> bool:
        if record:
            return float(record["expires"]) > time.time()
        first = self._unreadable_since.setdefault(path, time.monotonic())
        return time.monotonic() - first < seconds

    def take(self, key: str, holder: Holder, seconds: float) -> dict[str, Any]:
        """As ``RedisLeases.take``."""
        folder = self._folder(key)
        generations = self._generations(key)
        following = 0
        if generations:
            top = f"{folder}/{generations[-1]}"
            record = self._read(top)
            if record is not None and self._in_force(top, record, seconds):
                return record
            self._unreadable_since.pop(top, None)
            following = generations[-1] + 1
        mine = holder.record(seconds)
        path = f"{folder}/{following}"
        if not self._create_only(path, json.dumps(mine).encode()):
            return self._read(path) or {}
        for older in generations:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{folder}/{older}")
        return mine

    def _create_only(self, path: str, data: bytes) -> bool:
        """Write ``data`` at ``path`` unless an object is there, atomically where the filesystem can (``xb``:
        ``O_EXCL`` locally, conditional writes on object stores). Elsewhere: check, write, read back."""
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        try:
            with self.fs.open(path, "xb") as handle:
                handle.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError, TypeError):
            pass  # no exclusive-create mode here
        if self.fs.exists(path):
            return False
        self.fs.pipe_file(path, data)
        return self.fs.cat_file(path) == data

    def _holding(self, key: str, holder: Holder) -> str | None:
        """The path of ``holder``'s generation of ``key`` while it is still there and still its own."""
        folder = self._folder(key)
        for generation in reversed(self._generations(key)):
            path = f"{folder}/{generation}"
            record = self._read(path)
            if record and record.get("token") == holder.token:
                return path
        return None

    def renew(self, key: str, holder: Holder, seconds: float) -> bool:
        path = self._holding(key, holder)
        if path is None:
            return False
        temp = f"{path}.renew-{uuid.uuid4().hex}"
        self.fs.pipe_file(temp, json.dumps(holder.record(seconds)).encode())
        self.fs.mv(temp, path)  # replaces only the holder's own generation: a taker writes the next one
        return True

    def release(self, key: str, holder: Holder) -> bool:
        path = self._holding(key, holder)
        if path is None:
            return False
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True
