"""The size cap holds after every write; what goes first is what saves least per byte kept."""

from __future__ import annotations

import random

from tpucompile.cache import Entry, PersistentCache, encode


def _entry(n: int, size: int, seconds: float) -> Entry:
    return Entry.create({"kind": "executable", "n": n}, random.Random(n).randbytes(size), {}, seconds)


def _disk_bytes(cache: PersistentCache) -> int:
    return sum(cache.local.size(k) or 0 for k in cache.local.list_keys())


def test_cap_holds_after_every_put(tmp_path):
    cap = 60_000
    cache = PersistentCache(tmp_path, max_size=cap)
    rng = random.Random(1)
    for n in range(40):
        cache.put(_entry(n, rng.randrange(1_000, 12_000), rng.uniform(0.01, 2.0)))
        assert _disk_bytes(cache) <= cap
    assert cache.index.total_size() == _disk_bytes(cache)
    assert cache.index.counters()["evictions"] > 0


def test_most_valuable_entries_survive(tmp_path):
    cache = PersistentCache(tmp_path)
    cheap_big = _entry(1, 20_000, 0.01)      # quick to recompile, large: least valuable
    slow_small = _entry(2, 2_000, 5.0)       # slow to recompile, small: most valuable
    popular = _entry(3, 20_000, 0.01)        # cheap and large, but hit often
    for entry in (cheap_big, slow_small, popular):
        cache.put(entry)
    for _ in range(500):
        cache.record_hit(popular.key, 0.01)
    size = len(encode(slow_small)) + len(encode(popular)) + 100
    evicted = cache.prune(size)
    assert [k for k, _ in evicted] == [cheap_big.key]
    assert cache.local.contains(slow_small.key) and cache.local.contains(popular.key)


def test_reconcile_indexes_files_the_index_lacks(tmp_path):
    cache = PersistentCache(tmp_path)
    entry = _entry(5, 3_000, 1.0)
    cache.local.publish(entry.key, encode(entry))  # a file published by a writer that died before indexing
    assert cache.index.rows() == []
    assert cache.reconcile()["added"] == 1
    (row,) = cache.index.rows()
    assert row["key"] == entry.key and row["compile_seconds"] == 1.0
