"""Cache bundles: a set of entries in one file, to seed a cache on another machine (CI, a fleet, a container).

A bundle is an uncompressed tar with exactly these members:

    manifest.json    format, version, the exporting environment, and per entry: key, kind, size, SHA-256
    manifest.sig     optional: hex HMAC-SHA256 of manifest.json with TPUCOMPILE_CACHE_SIGNING_KEY
    entries/<key>    the entry bytes, exactly as stored in a cache directory

Importing checks everything before publishing anything: the signature (required when a signing key is
set: a deserialised executable is machine code, so an unsigned bundle from an unknown source must not be
loaded), that the members are exactly those the manifest lists with the digests it lists, that every entry
verifies, and that each entry was built for this environment; an entry that does not fit is skipped with
the component(s) that differ named. Nothing is ever extracted to a path taken from the archive.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import json
import os
import tarfile
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tpucompile.cache.entry import CorruptEntryError, decode
from tpucompile.cache.keys import canonical_json, digest, environment_mismatches, is_key
from tpucompile.cache.tiered import PersistentCache
from tpucompile.contracts.target_names import label as target_label

FORMAT = "tpucompile-cache-bundle"
VERSION = 1
SIGNING_KEY_ENV = "TPUCOMPILE_CACHE_SIGNING_KEY"
_MAX_MANIFEST = 64 << 20
_TARGET_COMPONENTS = ("platform", "platform_version", "device_kind", "device_count", "topology")


class BundleError(Exception):
    """The bundle is refused as a whole; the message says why."""


@dataclasses.dataclass
class ImportReport:
    imported: list[str] = dataclasses.field(default_factory=list)
    already_present: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    """key → why the entry does not fit this environment."""
    signed: bool = False
    verified_signature: bool = False


def signing_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    value = (os.environ if environ is None else environ).get(SIGNING_KEY_ENV, "")
    return value.encode() if value else None


def sign(manifest: bytes, key: bytes) -> str:
    return hmac.new(key, manifest, hashlib.sha256).hexdigest()


def export_bundle(
    cache: PersistentCache,
    path: str | os.PathLike[str],
    environment: Mapping[str, Any],
    keys: Iterable[str] | None = None,
    key: bytes | None = None,
) -> dict[str, Any]:
    """Write the verified local entries (all, or ``keys``) to ``path``; returns the manifest."""
    chosen = sorted(keys) if keys is not None else sorted(cache.local.list_keys())
    members: list[tuple[str, bytes]] = []
    listed = []
    for entry_key in chosen:
        data = cache.local.read(entry_key)
        if data is None:
            continue
        try:
            entry = decode(data, entry_key)
        except CorruptEntryError as error:
            cache.quarantine(entry_key, str(error))
            continue
        listed.append({"key": entry_key, "kind": entry.kind, "size": len(data), "sha256": digest(data)})
        members.append((f"entries/{entry_key}", data))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "created": time.time(),
        "environment": dict(environment),
        "entries": listed,
    }
    manifest_bytes = canonical_json(manifest)
    members.insert(0, ("manifest.json", manifest_bytes))
    if key is not None:
        members.insert(1, ("manifest.sig", sign(manifest_bytes, key).encode()))
    temp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with tarfile.open(temp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = int(manifest["created"])
            tar.addfile(info, io.BytesIO(data))
    os.replace(temp, path)
    return manifest


def import_bundle(
    cache: PersistentCache,
    path: str | os.PathLike[str],
    environment: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    key: bytes | None = None,
) -> ImportReport:
    """Check ``path`` completely, then publish the entries that fit this environment (or any of several: this
    machine's and those of compile-only targets) into ``cache``."""
    environments = [environment] if isinstance(environment, Mapping) else list(environment)
    if not cache.writable:
        raise BundleError(f"the cache at {cache.local.root} is {cache.mode}: nothing can be imported into it")
    report = ImportReport()
    members = _read_members(path)
    manifest_bytes = members.pop("manifest.json", None)
    if manifest_bytes is None:
        raise BundleError("not a tpucompile cache bundle: it has no manifest.json")
    signature = members.pop("manifest.sig", None)
    report.signed = signature is not None
    if key is not None:
        if signature is None:
            raise BundleError(f"the bundle is not signed, and {SIGNING_KEY_ENV} is set: refusing unsigned entries")
        if not hmac.compare_digest(signature.decode("ascii", "replace").strip(), sign(manifest_bytes, key)):
            raise BundleError("the bundle's signature does not match its manifest: it was altered after signing, "
                              f"or signed with a different {SIGNING_KEY_ENV}")
        report.verified_signature = True
    try:
        manifest = json.loads(manifest_bytes)
    except ValueError as error:
        raise BundleError(f"manifest.json is not JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise BundleError("manifest.json is not a version-1 tpucompile cache bundle manifest")
    listed = {item.get("key"): item for item in manifest.get("entries", []) if isinstance(item, dict)}
    names = {f"entries/{k}" for k in listed}
    if set(members) != names:
        extra = sorted(set(members) - names)
        missing = sorted(names - set(members))
        raise BundleError(f"the bundle's members do not match its manifest (unlisted: {extra[:3]}, "
                          f"missing: {missing[:3]}): it was tampered with or truncated")
    entries = []
    for entry_key, item in listed.items():
        data = members[f"entries/{entry_key}"]
        if not is_key(str(entry_key)) or digest(data) != item.get("sha256"):
            raise BundleError(f"entry {str(entry_key)[:16]} does not match its digest in the manifest: the "
                              "bundle was tampered with or corrupted")
        try:
            entry = decode(data, entry_key)
        except CorruptEntryError as error:
            raise BundleError(f"entry {entry_key[:16]} is not a valid cache entry: {error}") from None
        entries.append((entry, data))
    for entry, data in entries:
        mismatches = min((environment_mismatches(entry.components, e) for e in environments), key=len)
        if mismatches:
            reasons = []
            if "platform" in mismatches:  # another target altogether: say which, not every component of it
                reasons.append(f"built for {target_label(entry.components)}, not for this machine "
                               f"(`cache import --target {target_label(entry.components)}` keeps it)")
                mismatches = {k: v for k, v in mismatches.items() if k not in _TARGET_COMPONENTS}
            reasons += [f"{name}: built with {_short(old)}, this environment has {_short(new)}"
                        for name, (old, new) in sorted(mismatches.items())]
            report.skipped[entry.key] = "; ".join(reasons)
            continue
        if cache.local.contains(entry.key):
            report.already_present.append(entry.key)
            continue
        cache.publish_local(entry, data)
        report.imported.append(entry.key)
    return report


def _read_members(path: str | os.PathLike[str]) -> dict[str, bytes]:
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(path, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    raise BundleError(f"bundle member {info.name!r} is not a regular file")
                if info.name in members:
                    raise BundleError(f"bundle member {info.name!r} appears twice")
                if info.size > _MAX_MANIFEST and not info.name.startswith("entries/"):
                    raise BundleError(f"bundle member {info.name!r} is implausibly large")
                stream = tar.extractfile(info)
                members[info.name] = stream.read() if stream is not None else b""
    except (tarfile.TarError, EOFError) as error:
        raise BundleError(f"not a readable bundle: {error}") from None
    return members


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
