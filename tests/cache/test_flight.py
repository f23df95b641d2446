"""Single-flight: one process compiles a key, the others wait for it; a dead or stuck holder cannot block."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from tests import python_processes
from tests.cached_runs import finish, start_workload, workload_env
from tpucompile.cache.flight import SingleFlight

KEY = "ab" * 32


def test_eight_processes_one_compile(tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = workload_env(tmp_path / "cache")
    runs = [start_workload(env, ["--barrier", str(barrier), "8"]) for _ in range(8)]
    results = [finish(run) for run in runs]
    assert all(r["ok"] for r in results), "every process computes the right result"
    events = [e for r in results for e in r["events"]]
    assert len(events) == 8 and len({e["key"] for e in events}) == 1
    compiled = [e for e in events if e["tier"] is None]
    assert len(compiled) == 1, [e["tier"] for e in events]
    assert all(e["tier"] == "local" for e in events if e["tier"] is not None)


def test_threads_share_one_claim(tmp_path):
    flight = SingleFlight(tmp_path)
    inside = []
    overlap = []

    def worker():
        with flight.claim(KEY) as held:
            assert held
            overlap.append(len(inside))
            inside.append(1)
            time.sleep(0.02)
            inside.pop()

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert overlap == [0] * 6


_HOLDER = r"""
import sys, time
from pathlib import Path
from tpucompile.cache.flight import SingleFlight
flight = SingleFlight(Path(sys.argv[1]), lease_seconds=float(sys.argv[2]))
with flight.claim(sys.argv[3]):
    print("holding", flush=True)
    time.sleep(600)
"""


def _holder(tmp_path, lease: float) -> subprocess.Popen:
    holder = python_processes.popen([sys.executable, "-c", _HOLDER, str(tmp_path), str(lease), KEY],
                                    stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_waiter_takes_over_from_a_killed_holder(tmp_path):
    holder = _holder(tmp_path, lease=600)
    flight = SingleFlight(tmp_path)
    threading.Timer(0.5, holder.send_signal, [signal.SIGKILL]).start()
    start = time.monotonic()
    with flight.claim(KEY) as held:
        waited = time.monotonic() - start
    holder.wait()
    assert held, "the kernel released the dead holder's lock: the waiter holds it and compiles itself"
    assert 0.3 < waited < 10


def test_waiter_gives_up_on_a_stuck_holder_after_its_lease(tmp_path):
    holder = _holder(tmp_path, lease=1.0)
    holder.send_signal(signal.SIGSTOP)  # alive, holding the lock, making no progress
    try:
        start = time.monotonic()
        with SingleFlight(tmp_path).claim(KEY) as held:
            waited = time.monotonic() - start
        assert not held and waited < 10
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_waiter_returns_when_the_entry_is_published(tmp_path):
    holder = _holder(tmp_path, lease=600)
    try:
        published = threading.Event()
        threading.Timer(0.3, published.set).start()
        with SingleFlight(tmp_path).claim(KEY, published=published.is_set) as held:
            assert not held
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_lock_file_that_cannot_be_made_is_no_error(tmp_path):
    """A lock folder where no file can be created (read-only, a full disk; here a path through a regular
    file): the claim is not held, the caller compiles without the cross-process lock instead of failing."""
    (tmp_path / "plain-file").write_text("")
    with SingleFlight(tmp_path / "plain-file" / "locks").claim(KEY) as held:
        assert not held
