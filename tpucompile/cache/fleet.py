"""Single flight across hosts: one host of a fleet compiles a key, the others wait for its entry.

Hosts share no directory, only the remote tier, so the claim is a lease in the remote store
(``remote_lease.py``). The host that takes it compiles, publishes, then releases it; a thread renews it every
third of its duration meanwhile, so a compile may take as long as it needs, while a holder that dies stops
renewing and its lease runs out (``lease_seconds`` after its last renewal). The others poll the local and the
remote tier for the entry, and the lease, at growing intervals: they stop waiting when the entry is there
(the caller loads it), when they take the lease (its holder died or failed without publishing), after
``max_wait`` seconds (a holder that renews but never finishes), or when the remote stops answering. The
remote goes through ``GuardedRemote``, so a down or slow remote costs at most one timeout, after which
every call returns at once for the cool-down and the host compiles on its own: the lease never fails a
compile, and every wait is bounded.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from tpucompile.cache.remote import GuardedRemote
from tpucompile.cache.remote_lease import Holder

log = logging.getLogger("tpucompile")


class FleetClaims:
    """Per-key remote leases over ``remote``."""

    def __init__(self, remote: GuardedRemote, lease_seconds: float = 60.0, max_wait: float = 1800.0,
                 poll: float = 0.05, max_poll: float = 1.0) -> None:
        if not lease_seconds > 0:
            raise ValueError(f"the remote lease must last a positive number of seconds, got {lease_seconds!r}")
        if not max_wait >= 0:
            raise ValueError(f"the longest wait for another host must be >= 0 seconds, got {max_wait!r}")
        self.remote = remote
        self.lease_seconds = lease_seconds
        self.max_wait = max_wait
        self.poll = poll
        self.max_poll = max_poll
        self.counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def claim(self, key: str, published: Callable[[], bool]) -> Iterator[bool]:
        """Hold ``key``'s remote lease while compiling it. Yields True when this host holds it, False when it
        does not (the entry was published meanwhile, the remote is unavailable, or the wait ran out); either
        way the caller re-checks the cache and compiles only if the entry is still missing."""
        holder = Holder(uuid.uuid4().hex, socket.gethostname(), os.getpid())
        if not self._wait_for_lease(key, holder, published):
            yield False
            return
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(key, holder, stop), name="tpucompile-lease",
                                   daemon=True)
        renewer.start()
        try:
            yield True
        finally:
            stop.set()
            renewer.join(self.remote.timeout + 1)  # a renewal still in flight must not outlive the release
            self.remote.release_lease(key, holder)

    def _wait_for_lease(self, key: str, holder: Holder, published: Callable[[], bool]) -> bool:
        """True once ``holder`` holds the lease; False when the caller should go on without it."""
        deadline = time.monotonic() + self.max_wait
        delay = self.poll
        waited = False
        while True:
            record = self.remote.take_lease(key, holder, self.lease_seconds)
            if record is None:
                self._count("remote_unavailable")
                return False
            if record.get("token") == holder.token:
                self._count("taken_after_wait" if waited else "taken")
                return True
            if not waited:
                waited = True
                self._count("waited")
                log.info("tpucompile: waiting for %s (pid %s) to compile %s", record.get("host", "another host"),
                         record.get("pid", "?"), key[:16])
            if published():
                self._count("published_while_waiting")
                return False
            if time.monotonic() >= deadline:
                self._count("wait_expired")
                log.warning("tpucompile: %s is still being compiled by %s (pid %s) after %.0fs; compiling it here",
                            key[:16], record.get("host", "another host"), record.get("pid", "?"), self.max_wait)
                return False
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, self.max_poll)

    def _renew(self, key: str, holder: Holder, stop: threading.Event) -> None:
        """Renew the lease every third of its length until ``stop``. A lease that lapsed while this process
        stalled is taken again when nobody else took it meanwhile, so other hosts keep waiting for this
        compile instead of starting their own; when another host took it, that host compiles too."""
        while not stop.wait(self.lease_seconds / 3):
            renewed = self.remote.renew_lease(key, holder, self.lease_seconds)
            if renewed is not False:  # renewed, or the remote did not answer (tried again next time)
                continue
            record = self.remote.take_lease(key, holder, self.lease_seconds)
            if record is None or record.get("token") == holder.token:
                continue
            log.debug("tpucompile: lost the remote lease of %s while compiling it", key[:16])
            return

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    def describe(self) -> dict[str, Any]:
        return {"lease_seconds": self.lease_seconds, "max_wait": self.max_wait, **self.counters}
