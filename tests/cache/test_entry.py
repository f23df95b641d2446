"""Entries are verified on every read: any altered, torn or misfiled byte is detected, never served."""

from __future__ import annotations

import random

import pytest

from tpucompile.cache import CorruptEntryError, Entry, decode, encode
from tpucompile.cache.entry import read_header


def _entry(size: int = 5000) -> Entry:
    rng = random.Random(size)
    payload = bytes(rng.getrandbits(8) for _ in range(size))
    components = {"kind": "executable", "program": "ab" * 32, "jaxlib": "0.10.2", "inputs": [["float32", [2]]]}
    return Entry.create(components, payload, {"name": "graph 0 (forward)"}, compile_seconds=1.25)


def test_round_trip_keeps_everything():
    entry = _entry()
    data = encode(entry)
    decoded = decode(data, entry.key)
    assert decoded == entry
    header = read_header(data)
    assert header["key"] == entry.key and header["payload_size"] == 5000 and header["compile_seconds"] == 1.25
    assert b"pickle" not in data and data.startswith(b"TPUCACHE")


def test_every_random_corruption_is_detected():
    entry = _entry()
    data = encode(entry)
    rng = random.Random(0)
    for trial in range(600):
        damaged = bytearray(data)
        how = trial % 4
        if how == 0:  # flip one bit anywhere (header, payload, metadata or trailer)
            position = rng.randrange(len(damaged))
            damaged[position] ^= 1 << rng.randrange(8)
        elif how == 1:  # overwrite a run of bytes with random ones
            start = rng.randrange(len(damaged) - 16)
            for i in range(start, start + rng.randrange(1, 16)):
                damaged[i] = (damaged[i] + rng.randrange(1, 256)) % 256
        elif how == 2:  # torn write: truncated
            damaged = damaged[: rng.randrange(len(damaged))]
        else:  # garbage appended
            damaged += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        with pytest.raises(CorruptEntryError):
            decode(bytes(damaged), entry.key)


def test_entry_under_the_wrong_key_is_refused():
    entry = _entry()
    with pytest.raises(CorruptEntryError, match="expected"):
        decode(encode(entry), "0" * 64)


def test_components_that_do_not_hash_to_the_key_are_refused():
    entry = _entry()
    forged = Entry(key=entry.key, kind=entry.kind, components={**entry.components, "jaxlib": "9"},
                   payload=entry.payload, metadata=entry.metadata, compile_seconds=1.0, created=entry.created)
    with pytest.raises(CorruptEntryError, match="do not hash"):
        decode(encode(forged))
