"""The on-disk (and on-wire) form of one cache entry, without pickle.

    magic "TPUCACHE" | u32 header length | header JSON | payload | metadata JSON | SHA-256 of all before

The header names the key, kind, component digests, sizes, payload digest and compile time; the payload is
raw bytes (a serialised executable, or StableHLO bytecode); the metadata is plain JSON holding the full key
components and whatever the writer needs to rebuild its value. The trailing digest covers every byte, so
any corruption is detected, and decoding re-derives the key from the stored components, so an entry filed
under the wrong key is never served.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import time
from typing import Any

from tpucompile.cache.keys import cache_key, canonical_json, component_digests, digest

MAGIC = b"TPUCACHE"
SCHEMA = 1
_LENGTH = struct.Struct("<I")
_TRAILER = 32
_MAX_HEADER = 1 << 20


class CorruptEntryError(Exception):
    """An entry's bytes fail a check; the message says which one."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One decoded entry."""

    key: str
    kind: str
    components: dict[str, Any]
    payload: bytes
    metadata: dict[str, Any]
    compile_seconds: float
    created: float

    @classmethod
    def create(
        cls, components: dict[str, Any], payload: bytes, metadata: dict[str, Any], compile_seconds: float
    ) -> Entry:
        """A new entry whose key is derived from ``components``."""
        return cls(
            key=cache_key(components),
            kind=str(components.get("kind", "")),
            components=dict(components),
            payload=bytes(payload),
            metadata=dict(metadata),
            compile_seconds=float(compile_seconds),
            created=time.time(),
        )


def encode(entry: Entry) -> bytes:
    """The bytes stored for ``entry``."""
    metadata = canonical_json({"components": entry.components, "metadata": entry.metadata})
    header = canonical_json(
        {
            "schema": SCHEMA,
            "key": entry.key,
            "kind": entry.kind,
            "component_digests": component_digests(entry.components),
            "payload_size": len(entry.payload),
            "payload_sha256": digest(entry.payload),
            "metadata_size": len(metadata),
            "compile_seconds": entry.compile_seconds,
            "created": entry.created,
        }
    )
    body = b"".join([MAGIC, _LENGTH.pack(len(header)), header, entry.payload, metadata])
    return body + hashlib.sha256(body).digest()


def read_header(data: bytes) -> dict[str, Any]:
    """The header of an entry's leading bytes, without verifying the rest (listing, index rebuilds)."""
    if data[: len(MAGIC)] != MAGIC:
        raise CorruptEntryError("bad magic (not a tpucompile cache entry)")
    if len(data) < len(MAGIC) + _LENGTH.size:
        raise CorruptEntryError("truncated before the header length")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    if length > _MAX_HEADER or start + length > len(data):
        raise CorruptEntryError(f"header length {length} does not fit the entry")
    try:
        header = json.loads(data[start : start + length])
    except ValueError as error:
        raise CorruptEntryError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict) or header.get("schema") != SCHEMA:
        raise CorruptEntryError(f"unknown entry schema {header.get('schema') if isinstance(header, dict) else '?'}")
    header["_header_end"] = start + length
    return header


def decode(data: bytes, expected_key: str | None = None) -> Entry:
    """Verify and decode an entry; raise ``CorruptEntryError`` on any mismatch."""
    if len(data) < len(MAGIC) + _LENGTH.size + _TRAILER:
        raise CorruptEntryError(f"truncated ({len(data)} bytes)")
    body, trailer = data[:-_TRAILER], data[-_TRAILER:]
    if hashlib.sha256(body).digest() != trailer:
        raise CorruptEntryError("checksum mismatch (entry bytes were altered or torn)")
    header = read_header(body)
    start = header["_header_end"]
    try:
        payload_size = int(header["payload_size"])
        metadata_size = int(header["metadata_size"])
        key = str(header["key"])
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptEntryError(f"header lacks {error}") from None
    if start + payload_size + metadata_size != len(body):
        raise CorruptEntryError("sizes in the header do not add up to the entry's length")
    payload = body[start : start + payload_size]
    if digest(payload) != header.get("payload_sha256"):
        raise CorruptEntryError("payload digest mismatch")
    try:
        stored = json.loads(body[start + payload_size :])
        components, metadata = stored["components"], stored["metadata"]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptEntryError(f"metadata is not valid: {error}") from None
    if cache_key(components) != key:
        raise CorruptEntryError("stored components do not hash to the stored key")
    if component_digests(components) != header.get("component_digests"):
        raise CorruptEntryError("component digests do not match the stored components")
    if expected_key is not None and key != expected_key:
        raise CorruptEntryError(f"entry holds key {key[:16]}…, expected {expected_key[:16]}…")
    return Entry(
        key=key,
        kind=str(header.get("kind", "")),
        components=components,
        payload=payload,
        metadata=metadata,
        compile_seconds=float(header.get("compile_seconds", 0.0)),
        created=float(header.get("created", 0.0)),
    )


def read_components(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key components stored in the entry file at ``path``, reading only its header and metadata, not
    its payload and without verifying it (listing by target); ``CorruptEntryError`` when they cannot be read."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(64 * 1024)
            header = read_header(head if len(head) < 64 * 1024 else head + stream.read(_MAX_HEADER))
            stream.seek(header["_header_end"] + int(header["payload_size"]))
            stored = json.loads(stream.read(int(header["metadata_size"])))
        components = stored["components"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptEntryError(f"cannot read the components: {error}") from None
    if not isinstance(components, dict):
        raise CorruptEntryError("the stored components are not a mapping")
    return components
