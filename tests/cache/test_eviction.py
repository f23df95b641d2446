"""The size cap holds after every write; what goes first is what saves least per byte kept; pruning never
fails or misleads a reader."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import torch

from tests import python_processes
from tests.cached_runs import compile_and_run, fault_repetitions, report
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


_PRUNER = r"""
import json, sys, time
from tests.cached_runs import entry_payload
from tpucompile.cache import Entry, PersistentCache
root, count, cap, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
cache = PersistentCache(root)
entries = [Entry.create({"kind": "executable", "n": n, "seed": "prune"}, entry_payload("prune", n, 200_000), {},
                        0.1 + n % 7) for n in range(count)]
rounds = evicted = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:  # refill, then evict down to the cap or to nothing, in turn
    for entry in entries:
        cache.put(entry)
    evicted += len(cache.prune(cap if rounds % 2 else 0))
    rounds += 1
print(json.dumps({"rounds": rounds, "evicted": evicted}))
"""

_READER = r"""
import json, random, sys, time
from tests.cached_runs import entry_payload
from tpucompile.cache import PersistentCache, cache_key
root, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
cache = PersistentCache(root)
served = missed = wrong = failed = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for n in random.sample(range(count), count):
        try:
            found = cache.get(cache_key({"kind": "executable", "n": n, "seed": "prune"}))
        except Exception as error:
            failed += 1
            print(repr(error), file=sys.stderr)
            continue
        if found is None:
            missed += 1
        else:
            served += 1
            wrong += found[0].payload != entry_payload("prune", n, 200_000)
print(json.dumps({"served": served, "missed": missed, "wrong": wrong, "failed": failed,
                  "quarantined": cache.quarantined}))
"""


def test_prune_while_other_processes_read(cache_dir):
    """One process refills 30 entries and prunes the directory down to a third of them or to nothing, in turn,
    again and again, while two processes read them all in random order and this one compiles a graph again
    and again from the same directory: no read fails, every entry served holds its writer's bytes (nothing
    half-deleted is ever served or even seen), and every compile is right, including those whose entries
    were evicted under them. 3 s; 15 s with $TPUCOMPILE_FULL_FAULTS=1."""
    seconds = fault_repetitions(3, 15)
    count = 30
    cap = count * 100_000 // 3
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    compile_and_run(_graph, x, y)  # this process's first compile sets up XLA: not the part under test
    pruner = python_processes.popen([sys.executable, "-c", _PRUNER, str(cache_dir), str(count), str(cap), str(seconds)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    readers = [python_processes.popen([sys.executable, "-c", _READER, str(cache_dir), str(count), str(seconds)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    compiles = wrong_compiles = recompiled = 0
    while pruner.poll() is None:
        result, (event,) = compile_and_run(_graph, x, y)
        compiles += 1
        wrong_compiles += not torch.allclose(result, _graph(x, y))
        recompiled += event.tier is None  # its executable had been evicted
    outcomes = []
    for process in [pruner, *readers]:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-3000:]
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    pruned, reads = outcomes[0], outcomes[1:]
    total = {name: sum(r[name] for r in reads) for name in reads[0]}
    report("prune_while_reading", prune_rounds=pruned["rounds"], evicted=pruned["evicted"], **total,
           compiles=compiles, recompiled_after_eviction=recompiled, wrong_compiles=wrong_compiles)
    assert pruned["evicted"] > 0 and total["served"] > 0 and total["missed"] > 0, "the readers met the pruner"
    assert total["failed"] == 0 and total["wrong"] == 0 and total["quarantined"] == 0
    assert recompiled > 0 and wrong_compiles == 0, "the compiles met the pruner too, and were all right"


def _graph(x, y):
    return torch.relu(x @ y) - 0.5
