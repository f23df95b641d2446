"""The local directory tier: create-only, atomic publishing that a SIGKILL at any moment cannot tear."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from tpucompile.cache import Entry, LocalStore, PersistentCache, decode, encode

_WRITER = r"""
import os, random, sys
from tpucompile.cache import Entry, PersistentCache
cache = PersistentCache(sys.argv[1])
rng = random.Random(int(sys.argv[2]))
print("ready", flush=True)
for n in range(10**6):
    payload = rng.randbytes(rng.randrange(1, 3 << 20))
    cache.put(Entry.create({"kind": "executable", "n": n, "seed": sys.argv[2]}, payload, {}, 0.5))
"""


def test_sigkilled_writers_leave_no_torn_entry(tmp_path):
    rng = random.Random(7)
    published = 0
    for trial in range(20):
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(trial)],
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    store = LocalStore(tmp_path)
    for key in store.list_keys():
        decode(store.read(key), key)  # raises on a torn or partial entry
        published += 1
    assert published > 0
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
