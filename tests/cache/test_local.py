"""The local directory tier: create-only, atomic publishing that a SIGKILL at any moment cannot tear."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

from tests import python_processes
from tests.cached_runs import entry_payload, fault_repetitions, report
from tpucompile.cache import Entry, LocalStore, PersistentCache, decode, encode

_WRITER = r"""
import sys
from tests.cached_runs import entry_payload
from tpucompile.cache import Entry, PersistentCache
cache = PersistentCache(sys.argv[1])
seed = sys.argv[2]
print("ready", flush=True)
for n in range(10**6):
    cache.put(Entry.create({"kind": "executable", "n": n, "seed": seed}, entry_payload(seed, n), {}, 0.5))
"""


def test_sigkilled_writers_leave_no_torn_entry(tmp_path):
    """Writers of entries up to 3 MiB are SIGKILLed at random points (mid-write, mid-fsync, between the link
    and the index update) while a reader serves whatever is published: every entry it serves holds exactly
    the bytes its writer meant, and nothing it finds is torn. 10 writers; 50 with $TPUCOMPILE_FULL_FAULTS=1."""
    writers = fault_repetitions(10, 50)
    rng = random.Random(7)
    reader = PersistentCache(tmp_path)
    served, wrong = [0], [0]
    done = threading.Event()

    def serve() -> None:  # reads published entries the whole time the writers are being killed
        while not done.is_set():
            for key in list(reader.local.list_keys()):
                found = reader.get(key)
                if found is not None:
                    entry = found[0]
                    served[0] += 1
                    wrong[0] += entry.payload != entry_payload(entry.components["seed"], entry.components["n"])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        for trial in range(writers):
            writer = python_processes.popen([sys.executable, "-c", _WRITER, str(tmp_path), str(trial)],
                                            stdout=subprocess.PIPE, text=True)
            assert writer.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.25))
            writer.send_signal(signal.SIGKILL)
            writer.wait()
    finally:
        done.set()
        thread.join()
    store = LocalStore(tmp_path)
    published = 0
    for key in store.list_keys():
        entry = decode(store.read(key), key)  # raises on a torn or partial entry
        assert entry.payload == entry_payload(entry.components["seed"], entry.components["n"])
        published += 1
    left_behind = len(list(store.tmp.iterdir()))
    report("sigkill", writers_killed=writers, published=published, served=served[0], torn_served=wrong[0],
           torn_found=reader.quarantined, temp_files_left=left_behind)
    assert published > 0 and served[0] > 0
    assert wrong[0] == 0, "an entry was served with bytes its writer did not write"
    assert reader.quarantined == 0, "a reader found a torn entry in place (it was caught, but never should be)"
    # A killed writer leaves at most its temp file behind, which the next prune removes.
    store.clean_temp(older_than=0)
    assert not list(store.tmp.iterdir())


def test_publish_is_create_only(tmp_path):
    store = LocalStore(tmp_path)
    entry = Entry.create({"kind": "executable", "x": 1}, b"first", {}, 1.0)
    assert store.publish(entry.key, encode(entry))
    assert not store.publish(entry.key, b"something else")
    assert decode(store.read(entry.key), entry.key).payload == b"first"


def test_corrupt_local_entry_is_quarantined_and_counted(tmp_path):
    cache = PersistentCache(tmp_path)
    entry = Entry.create({"kind": "executable", "x": 2}, os.urandom(1000), {}, 1.0)
    cache.put(entry)
    path = cache.local.path(entry.key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cache.get(entry.key) is None
    assert not path.exists()
    assert cache.quarantined == 1
    assert any(p.name.startswith(entry.key) for p in cache.local.quarantine_dir.iterdir())
    assert cache.index.counters()["quarantined"] == 1
