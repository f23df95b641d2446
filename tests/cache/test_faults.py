"""Faults of the local cache directory, seen through the compiler: damaged entries, a full disk, a directory
that cannot be written. Whatever happens to the directory, a compile returns the right result; what is
damaged is detected and recompiled, never served; what cannot be written is skipped, never left half-written.

The corruption loop runs 20 rounds by default and 100 with ``TPUCOMPILE_FULL_FAULTS=1``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from tests import python_processes
from tests.cached_runs import compile_and_run, fault_repetitions, report
from tpucompile.cache import Entry, LocalStore, decode, encode
from tpucompile.cache.entry import MAGIC, read_header


def f(x, y):
    return torch.tanh(x @ y) * 2 + 1


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=generator), torch.randn(4, 5, generator=generator)


# -- damaged entries --


def _resigned(data: bytes, change: dict) -> bytes:
    """``data`` with its header fields updated by ``change`` and a trailing digest that matches again: damage
    the checksum cannot see, which only the checks behind it (key, sizes, digests, schema) can."""
    header = read_header(data)
    start = header.pop("_header_end")
    header.update(change)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = MAGIC + len(text).to_bytes(4, "little") + text + data[start:-32]
    return body + hashlib.sha256(body).digest()


def _damage(rng: random.Random, how: str, good: dict[str, bytes]) -> dict[str, bytes]:
    """New bytes for some of the entries in ``good`` (kind → bytes), damaged as ``how`` says."""
    kinds = sorted(good)
    chosen = rng.sample(kinds, rng.randrange(1, len(kinds) + 1))
    if how == "swapped":
        first, second = rng.sample(kinds, 2)
        return {first: good[second], second: good[first]}
    damaged = {}
    for kind in chosen:
        data = bytearray(good[kind])
        if how == "flipped":
            for _ in range(rng.randrange(1, 9)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif how == "truncated":
            data = data[: rng.randrange(len(data))]
        elif how == "wrong_key":  # a sound entry of another key, filed under this one
            entry = decode(bytes(data))
            other = Entry.create({**entry.components, "filed_under": "another key"}, entry.payload,
                                 entry.metadata, entry.compile_seconds)
            data = bytearray(encode(other))
        else:  # "wrong_header": a header field altered, the digest recomputed
            field, value = rng.choice([("key", "0" * 64), ("schema", 2), ("payload_size", 1),
                                       ("payload_sha256", "0" * 64),
                                       ("component_digests", {"kind": "0" * 64})])
            data = bytearray(_resigned(bytes(data), {field: value}))
        damaged[kind] = bytes(data)
    return damaged


def _quarantined(store: LocalStore) -> list[bytes]:
    return [p.read_bytes() for p in store.quarantine_dir.iterdir() if not p.name.endswith(".why")]


def test_damaged_entries_are_detected_and_never_served(cache_dir):
    """Each round damages the plan, program and executable entries of one graph (flipped bits, truncation,
    a sound entry of another key filed under this one, a header altered with its digest recomputed, two
    entries' files swapped) and compiles again: the result is right, every damaged entry is moved to
    quarantine byte for byte, and its layer is rebuilt instead of loaded. 20 rounds; 100 in full."""
    rounds = fault_repetitions(20, 100)
    x, y = _inputs()
    expected = f(x, y)
    compile_and_run(f, x, y)
    store = LocalStore(cache_dir)
    rng = random.Random(11)
    ways = ["flipped", "truncated", "wrong_key", "wrong_header", "swapped"]
    detected = wrong = 0
    seen = collections.Counter()
    for trial in range(rounds):
        paths = {decode(store.read(k), k).kind: store.path(k) for k in store.list_keys()}
        assert sorted(paths) == ["executable", "plan", "program"], "the last round republished every layer"
        how = ways[trial % len(ways)]
        damaged = _damage(rng, how, {kind: path.read_bytes() for kind, path in paths.items()})
        for kind, data in damaged.items():
            paths[kind].write_bytes(data)
        before = _quarantined(store)
        result, (event,) = compile_and_run(f, x, y)
        wrong += not torch.allclose(result, expected)
        moved = _quarantined(store)
        for data in before:
            moved.remove(data)
        rebuilt = {"plan": event.graph is not None, "program": event.program_tier is None,
                   "executable": event.tier is None}
        detected += sorted(moved) == sorted(damaged.values()) and all(rebuilt[kind] for kind in damaged)
        seen[how] += 1
    report("corruption", rounds=rounds, detected=detected, wrong_results=wrong, **seen)
    assert wrong == 0
    assert detected == rounds


# -- a full disk --


_FULL_DISK_RUN = r"""
import json, os, pathlib, resource, signal, sys
import torch
from tests.cached_runs import compile_and_run
from tests.cache.test_faults import f, _inputs
from tpucompile.cache import LocalStore, decode

def compile_once():
    result, (event,) = compile_and_run(f, x, y)
    return {"ok": bool(torch.allclose(result, f(x, y))), "tier": event.tier, "key": event.key}

def left_behind(cache):
    store = LocalStore(cache)
    whole = [decode(store.read(key), key).kind for key in store.list_keys()]  # raises on a partial entry
    temp = [p.name for p in store.tmp.iterdir()] + [p.name for p in store.locks.iterdir() if ".tmp" in p.name]
    return {"published": whole, "temp": temp}

def full_disk(how, cache):
    os.environ["TPUCOMPILE_CACHE_DIR"] = str(cache)
    if how == "fsize":  # every file this process writes stops at 4 KiB (EFBIG, not SIGXFSZ)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    else:  # fill the filesystem holding the cache, up to its last byte
        fd = os.open(cache.parent / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, bytes(4096))
        except OSError:
            pass
        os.close(fd)
    full = compile_once()
    full.update(left_behind(cache))
    if how == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    else:
        (cache.parent / "filler").unlink()
    room = compile_once()  # the next run: nothing in memory, room on disk
    room.update(left_behind(cache))
    return {"full": full, "room": room}

x, y = _inputs()
print(json.dumps({how: full_disk(how, pathlib.Path(cache)) for how, cache in map(lambda a: a.split("=", 1),
                                                                                 sys.argv[1:])}))
"""


def _tmpfs_wrapper() -> tuple[str, ...] | None:
    """``unshare`` into a private user and mount namespace, where a small tmpfs can be mounted without
    privileges; None where this system does not allow it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "-rm", "true"], capture_output=True)
    return (unshare, "-rm") if probe.returncode == 0 else None


def test_full_disk_during_publish(tmp_path):
    """A compile whose entries cannot be written, two ways in one process: ``fsize`` caps every file the
    process writes at 4 KiB with ``RLIMIT_FSIZE`` (this graph's plan and program entries are ~2 KiB, its
    executable ~10 KiB); ``tmpfs`` puts the cache on a 256 KiB tmpfs filled to its last byte (where
    ``unshare -rm`` can mount one; a warning says when it cannot). Each time the compile returns the right
    result, the executable entry is not published, no partial or temp file is left; the next run (nothing in
    memory, room on disk) recompiles the executable and publishes it."""
    mount = tmp_path / "small"
    mount.mkdir()
    command = [sys.executable, "-c", _FULL_DISK_RUN, f"fsize={tmp_path / 'capped' / 'cache'}"]
    wrap = _tmpfs_wrapper()
    if wrap is None:
        warnings.warn("no unprivileged mount namespace here (unshare -rm): the tmpfs case did not run", stacklevel=1)
    else:
        command = [*wrap, "sh", "-c", f'mount -t tmpfs -o size=256k tmpfs {mount} && exec "$@"', "sh", *command,
                   f"tmpfs={mount / 'cache'}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-3000:]
    for how, runs in json.loads(done.stdout.strip().splitlines()[-1]).items():
        full, room = runs["full"], runs["room"]
        report(f"disk_full_{how}", result_ok=full["ok"], published=",".join(full["published"]) or "nothing",
               temp_left=len(full["temp"]), next_run=room["tier"] or "recompiled")
        assert full["ok"], f"{how}: the compile on a full disk returned a wrong result"
        assert full["tier"] is None and "executable" not in full["published"], f"{how}: it cannot have fit"
        assert full["temp"] == [], f"{how}: temp files left behind: {full['temp']}"
        if how == "tmpfs":
            assert full["published"] == [], "nothing fits on a full disk"
        assert room["ok"] and room["tier"] is None and room["key"] == full["key"], f"{how}: the next run recompiles"
        assert "executable" in room["published"] and room["temp"] == [], f"{how}: and publishes once there is room"


# -- a directory that cannot be written --


def g(x, y):
    return torch.sigmoid(x @ y) - 1


_WARM_RUN = r"""
from tests.cached_runs import compile_and_run
from tests.cache.test_faults import f, _inputs
compile_and_run(f, *_inputs())
"""

_READ_ONLY_RUN = r"""
import json, torch
from tests.cached_runs import compile_and_run
from tests.cache.test_faults import f, g, _inputs
x, y = _inputs()
runs = {}
for fn in (f, g):
    result, (event,) = compile_and_run(fn, x, y)
    runs[fn.__name__] = {"ok": bool(torch.allclose(result, fn(x, y))), "tier": event.tier}
print(json.dumps(runs))
"""


def _snapshot(root: pathlib.Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def _without_write_permission() -> tuple[str, ...] | None:
    """How to run a process that file permissions bind: as it is, except for root, which chmod does not bind
    (then ``setpriv`` drops every capability, so root obeys the mode bits); None when that is not possible."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    return (setpriv, "--bounding-set=-all", "--inh-caps=-all") if setpriv else None


def test_read_only_directory_is_read_never_written(cache_dir):
    """A warm cache made read-only with ``chmod -R a-w``, used by a process in the default read-write mode:
    the cached graph loads from it, a new graph compiles, both results are right, nothing in the directory
    changes (no entry, lock, lease, temp file or index write), and the process says so once, not per entry."""
    wrap = _without_write_permission()
    if wrap is None:
        pytest.skip("running as root without setpriv: chmod cannot take write permission away")
    # the warm entry comes from a fresh process too: keys hold process-wide state (custom ops and JAX
    # lowerings other tests registered), which the reading process must share with the writer
    warm = python_processes.run([sys.executable, "-c", _WARM_RUN], capture_output=True, text=True, timeout=300,
                                cwd=os.getcwd())
    assert warm.returncode == 0, warm.stderr[-3000:]
    before = _snapshot(cache_dir)
    for path in [cache_dir, *cache_dir.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        done = subprocess.run([*wrap, sys.executable, "-c", _READ_ONLY_RUN], capture_output=True, text=True,
                              timeout=300, cwd=os.getcwd())
    finally:
        for path in [cache_dir, *cache_dir.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line or "tpucompile:" in line]
    report("read_only_chmod", cached=runs["f"]["tier"], new=runs["g"]["tier"] or "compiled",
           results_ok=runs["f"]["ok"] and runs["g"]["ok"], changed=len(set(_snapshot(cache_dir)) ^ set(before)),
           warnings=len(warnings))
    assert runs["f"] == {"ok": True, "tier": "local"} and runs["g"] == {"ok": True, "tier": None}
    assert _snapshot(cache_dir) == before, "a read-only cache directory was written"
    assert len(warnings) == 1 and "read-only" in warnings[0], warnings
