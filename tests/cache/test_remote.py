"""The remote tier: hits are written back locally; a dead or silent remote never fails or stalls a compile."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tests.cached_runs import compile_and_run, report
from tpucompile.artifacts import persistent_cache
from tpucompile.cache import Entry, LocalStore, PersistentCache, decode
from tpucompile.cache.remote import FsspecStore
from tpucompile.config import Options


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


def _command(buffer: bytes) -> tuple[list[bytes], int] | None:
    """The first whole Redis command in ``buffer`` (an array of bulk strings) and its length; None if cut."""
    def line(at: int) -> tuple[bytes, int] | None:
        end = buffer.find(b"\r\n", at)
        return None if end < 0 else (buffer[at:end], end + 2)

    head = line(0)
    if head is None:
        return None
    count, at = int(head[0][1:]), head[1]
    args = []
    for _ in range(count):
        size = line(at)
        if size is None:
            return None
        length, at = int(size[0][1:]), size[1]
        if len(buffer) < at + length + 2:
            return None
        args.append(buffer[at : at + length])
        at += length + 2
    return args, at


def _answer(connection: socket.socket, behaviour: str, delay: float) -> None:
    """Play a broken Redis on one connection: "slow" answers every command rightly (GET: no such key;
    anything else: OK) after ``delay`` seconds; "garbage" answers anything with bytes no client can parse."""
    buffer = b""
    with contextlib.suppress(OSError), connection:
        while chunk := connection.recv(65536):
            buffer += chunk
            if behaviour == "garbage":
                connection.sendall(b"<html>502 Bad Gateway</html>\r\n\x00\xff")
                continue
            while (parsed := _command(buffer)) is not None:
                args, used = parsed
                buffer = buffer[used:]
                time.sleep(delay)
                connection.sendall(b"$-1\r\n" if args[0].upper() == b"GET" else b"+OK\r\n")


@contextlib.contextmanager
def _broken_remote(behaviour: str, delay: float = 2.0) -> Iterator[str]:
    """The URL of a Redis that is "refused" (nothing listens), "silent" (connections are accepted, never
    answered), "slow" or "garbage" (see ``_answer``)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    url = f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    if behaviour == "refused":
        server.close()
        yield url
        return
    server.listen(16)
    stop = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                connection, _ = server.accept()
                if behaviour != "silent":
                    threading.Thread(target=_answer, args=(connection, behaviour, delay), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield url
    finally:
        stop.set()
        server.close()


@pytest.mark.parametrize("behaviour", ["refused", "silent", "slow", "garbage"])
def test_broken_remote_fails_no_compile_and_costs_one_call(tmp_path, monkeypatch, behaviour):
    """A remote that refuses connections, accepts them and never answers, answers each command 2 s late
    (past the 1 s timeout), or answers with garbage: three graphs compile to the right results, and the
    remote costs one failed call for the whole process (then it is skipped for its 30 s cool-down), so at
    most one timeout, not one per graph or per entry."""
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 6)
    failures = 0
    with _broken_remote(behaviour) as url:
        start = time.monotonic()
        for fn in (g, h, k):
            try:
                result, (event,) = compile_and_run(fn, x, cache_remote=url, cache_remote_timeout=1)
                failures += not torch.allclose(result, fn(x)) or event.tier is not None
            except Exception:
                failures += 1
        elapsed = time.monotonic() - start
        remote = persistent_cache(Options.from_sources({"cache_remote": url, "cache_remote_timeout": 1})).remote
    report(f"remote_{behaviour}", graphs=3, failures=failures, remote_calls_failed=remote.errors,
           seconds=round(elapsed, 1))
    assert failures == 0
    assert remote.errors == 1, "one failed call, then the remote is left alone for its cool-down"
    assert LocalStore(tmp_path).contains(event.key), "the local tier works as if there were no remote"


def test_remote_serving_damaged_entries_is_ignored(tmp_path, monkeypatch, caplog):
    """Every object of a shared remote damaged (one byte flipped): a host with an empty local cache compiles
    three graphs to the right results, refuses every damaged object (each executable is looked up twice,
    before and after its single-flight claim), and copies none of them locally."""
    remote = f"file://{tmp_path / 'remote'}"
    x = torch.randn(4, 6)
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "a"))
    for fn in (g, h, k):
        compile_and_run(fn, x, cache_remote=remote)
    objects = [p for p in (tmp_path / "remote").rglob("*") if p.is_file()]
    damaged = []
    for path in objects:
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(data))
        damaged.append(bytes(data))
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "b"))
    wrong = 0
    with caplog.at_level(logging.WARNING, logger="tpucompile"):
        for fn in (g, h, k):
            result, (event,) = compile_and_run(fn, x, cache_remote=remote)
            wrong += not torch.allclose(result, fn(x)) or event.tier is not None or event.program_tier is not None
    refused = {r.getMessage().split()[4] for r in caplog.records if "remote cache entry" in r.getMessage()}
    local = LocalStore(tmp_path / "b")
    kept = [local.read(key) for key in local.list_keys()]
    for data, key in zip(kept, local.list_keys(), strict=True):
        decode(data, key)
    counted = PersistentCache(tmp_path / "b").index.counters().get("remote_corrupt", 0)
    report("remote_damaged_entries", objects=len(objects), detected=len(refused), refusals=int(counted),
           wrong_results=wrong, copied_locally=sum(data in damaged for data in kept))
    assert wrong == 0
    assert refused == {path.name[:16] for path in objects}, "every damaged remote object was refused"
    assert counted >= len(objects)
    assert not any(data in damaged for data in kept)
