"""The remote tier: hits are written back locally; a dead or silent remote never fails or stalls a compile."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import torch

from tests.cache.cache_helpers import compile_and_run
from tpucompile.cache import Entry, LocalStore, PersistentCache
from tpucompile.cache.remote import FsspecStore


def g(x):
    return torch.sin(x) * 3 - x


def h(x):
    return torch.cos(x).sum(0) + 1


def k(x):
    return (x * x).mean(1)


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_remote_hit_is_written_back_locally(tmp_path, monkeypatch, scheme):
    remote = f"memory://tpucompile-test-{tmp_path.name}" if scheme == "memory" else f"file://{tmp_path / 'remote'}"
    x = torch.randn(5, 3)
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "a"))
    _, (cold,) = compile_and_run(g, x, cache_remote=remote)
    assert cold.tier is None
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "b"))  # a new machine: empty local cache
    result, (warm,) = compile_and_run(g, x, cache_remote=remote)
    torch.testing.assert_close(result, g(x))
    assert warm.tier == "remote" and warm.program_tier == "remote"
    assert LocalStore(tmp_path / "b").contains(warm.key), "remote hits are written back locally"
    _, (again,) = compile_and_run(g, x, cache_remote=remote)
    assert again.tier == "local"


def test_fsspec_store_is_create_only(tmp_path):
    store = FsspecStore(f"file://{tmp_path}", timeout=1)
    key = "cd" * 32
    assert store.put_if_absent(key, b"one")
    assert not store.put_if_absent(key, b"two")
    assert store.get(key) == b"one" and store.get("ef" * 32) is None


def test_corrupt_remote_entry_is_ignored(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    writer = PersistentCache(tmp_path / "a", remote=remote)
    entry = Entry.create({"kind": "executable", "x": 1}, b"payload" * 100, {}, 1.0)
    writer.put(entry)
    path = next((tmp_path / "remote").rglob(entry.key))
    data = bytearray(path.read_bytes())
    data[40] ^= 4
    path.write_bytes(bytes(data))
    reader = PersistentCache(tmp_path / "b", remote=remote)
    assert reader.get(entry.key) is None
    assert not reader.local.contains(entry.key)


def test_redis_stopped_mid_run_compiles_continue(tmp_path, monkeypatch, redis_server, caplog):
    server, url = redis_server
    x = torch.randn(4, 6)
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "a"))
    compile_and_run(g, x, cache_remote=url, cache_remote_timeout=1)
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "b"))
    _, (warm,) = compile_and_run(g, x, cache_remote=url, cache_remote_timeout=1)
    assert warm.tier == "remote"

    server.kill()
    server.wait()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tpucompile"):
        for fn in (h, k):
            result, (event,) = compile_and_run(fn, x, cache_remote=url, cache_remote_timeout=1)
            torch.testing.assert_close(result, fn(x))
            assert event.tier is None
    assert time.monotonic() - start < 20
    warnings = [r for r in caplog.records if "remote cache" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert LocalStore(tmp_path / "b").contains(event.key), "compiles still publish locally"


def test_silent_remote_costs_one_timeout_not_one_per_graph(tmp_path, monkeypatch):
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(16)  # accepts connections (backlog) but never answers
    url = f"redis://127.0.0.1:{blackhole.getsockname()[1]}/0"
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path))
    x = torch.randn(3, 3)
    try:
        start = time.monotonic()
        for fn in (g, h, k):
            result, _ = compile_and_run(fn, x, cache_remote=url, cache_remote_timeout=1)
            torch.testing.assert_close(result, fn(x))
        assert time.monotonic() - start < 12
    finally:
        blackhole.close()
