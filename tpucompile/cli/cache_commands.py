"""``tpucompile cache …``: list, count, check, shrink, compare, export and import the entries of the
persistent compile cache. All but export and import (which need this machine's environment) read only files
and the cache index, importing neither torch nor jax."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tpucompile.cache import PersistentCache, default_root, differing_components
from tpucompile.cache.bundle import export_bundle, import_bundle, signing_key
from tpucompile.cache.entry import CorruptEntryError, decode, read_components
from tpucompile.cache.keys import is_key
from tpucompile.cli.common import emit, options, target_names
from tpucompile.config import Options, parse_size
from tpucompile.contracts.target_names import label as target_label


def ls(args: argparse.Namespace) -> int:
    cache = _cache(args)
    if cache.writable:
        cache.reconcile()
    rows = cache.index.rows()
    for row in rows:
        row["target"] = _entry_target(cache, row["key"])
    wanted = target_names(args)
    if wanted:
        rows = [row for row in rows if row["target"] in wanted]
    width = max([len("target"), *(len(row["target"]) for row in rows)])
    lines = [f"{'key':16}  {'kind':10}  {'target':{width}}  {'size':>9}  {'compile s':>9}  {'hits':>5}  created"]
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created"]))
        lines.append(f"{row['key'][:16]}  {row['kind']:10}  {row['target']:{width}}  {_size(row['size']):>9}  "
                     f"{row['compile_seconds']:9.3f}  {row['hits']:5d}  {created}")
    emit(args, {"dir": str(cache.local.root), "entries": rows}, "\n".join(lines))
    return 0


def stats(args: argparse.Namespace) -> int:
    cache = _cache(args)
    if cache.writable:
        cache.reconcile()
    rows = cache.index.rows()
    counters = cache.index.counters()
    by_kind: dict[str, dict[str, float]] = {}
    for row in rows:
        kind = by_kind.setdefault(row["kind"], {"entries": 0, "bytes": 0})
        kind["entries"] += 1
        kind["bytes"] += row["size"]
    quarantined = [p for p in cache.local.quarantine_dir.glob("*") if p.suffix != ".why"] \
        if cache.local.quarantine_dir.exists() else []
    document = {
        "dir": str(cache.local.root),
        "entries": len(rows),
        "bytes": sum(r["size"] for r in rows),
        "by_kind": by_kind,
        "hits": int(counters.get("hits", 0)),
        "misses": int(counters.get("misses", 0)),
        "seconds_saved": round(counters.get("seconds_saved", 0.0), 3),
        "graph_compiles": int(counters.get("graph_compiles", 0)),
        "recompiles": int(counters.get("recompiles", 0)),
        "bucket_hits": int(counters.get("bucket_hits", 0)),
        "evictions": int(counters.get("evictions", 0)),
        "quarantined_total": int(counters.get("quarantined", 0)),
        "in_quarantine": len(quarantined),
    }
    text = "\n".join([
        f"cache {document['dir']}: {document['entries']} entries, {_size(document['bytes'])}",
        *(f"  {kind}: {v['entries']} entries, {_size(v['bytes'])}" for kind, v in sorted(by_kind.items())),
        f"  hits {document['hits']}, misses {document['misses']}, "
        f"{document['seconds_saved']:.1f} s of compiling saved",
        f"  by the processes that used it: {document['graph_compiles']} executables compiled, "
        f"{document['recompiles']} of them for a new size or bucket, {document['bucket_hits']} calls served by "
        f"a bucket's executable compiled before",
        f"  evictions {document['evictions']}, quarantined {document['quarantined_total']} "
        f"({document['in_quarantine']} files in quarantine)",
    ])
    emit(args, document, text)
    return 0


def verify(args: argparse.Namespace) -> int:
    cache = _cache(args)
    ok, corrupt = 0, {}
    for key in sorted(cache.local.list_keys()):
        data = cache.local.read(key)
        if data is None:
            continue
        try:
            decode(data, key)
            ok += 1
        except CorruptEntryError as error:
            corrupt[key] = str(error)
            cache.quarantine(key, str(error))
    reconciled = cache.reconcile() if cache.writable else {}
    lines = [f"{ok} entries verified, {len(corrupt)} corrupt (quarantined)"]
    lines += [f"  {key[:16]}: {why}" for key, why in corrupt.items()]
    emit(args, {"ok": ok, "corrupt": corrupt, "index": reconciled}, "\n".join(lines))
    return 1 if corrupt else 0


def prune(args: argparse.Namespace) -> int:
    cache = _cache(args)
    limit = parse_size(args.max_size)
    reconciled = cache.reconcile()
    before = cache.index.total_size()
    evicted = cache.prune(limit)
    after = cache.index.total_size()
    document = {"max_size": limit, "bytes_before": before, "bytes_after": after,
                "evicted": [k for k, _ in evicted], "index": reconciled}
    emit(args, document, f"evicted {len(evicted)} entries: {_size(before)} -> {_size(after)} "
         f"(cap {_size(limit)})")
    return 0


def explain(args: argparse.Namespace) -> int:
    cache = _cache(args)
    entries = []
    for key in (_resolve(cache, args.key_a), _resolve(cache, args.key_b)):
        found = cache.get(key)
        if found is None:
            raise ValueError(f"no valid cache entry {key[:16]} (in {cache.local.root} or the remote)")
        entries.append(found[0])
    first, second = entries
    differing = differing_components(first.components, second.components)
    details = {name: {"a": first.components.get(name), "b": second.components.get(name)} for name in differing}
    lines = [f"{first.key[:16]} vs {second.key[:16]}: " +
             (f"{len(differing)} component(s) differ: {', '.join(differing)}" if differing else "same components")]
    for name in differing:
        lines.append(f"  {name}:\n    a: {_clip(details[name]['a'])}\n    b: {_clip(details[name]['b'])}")
    emit(args, {"a": first.key, "b": second.key, "differing": differing, "details": details}, "\n".join(lines))
    return 0


def _clip(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:197] + "..."


def export(args: argparse.Namespace) -> int:
    cache = _cache(args)
    keys = [_resolve(cache, k) for k in args.keys] if args.keys else None
    wanted = target_names(args)
    if wanted:
        keys = [k for k in (keys if keys is not None else cache.local.list_keys()) if _entry_target(cache, k) in wanted]
    key = signing_key()
    manifest = export_bundle(cache, args.bundle, _environment(options(args)), keys, key)
    count = len(manifest["entries"])
    emit(args, {"bundle": args.bundle, "entries": count, "signed": key is not None},
         f"exported {count} entries to {args.bundle} ({'signed' if key else 'unsigned'})")
    return 0


def import_(args: argparse.Namespace) -> int:
    cache = _cache(args)
    environments = [_environment(options(args))]
    if target_names(args):
        from tpucompile import artifacts
        from tpucompile.runtime.targets.compile_only import compile_targets

        environments += [artifacts.environment(t) for t in compile_targets(tuple(target_names(args)))]
    report = import_bundle(cache, args.bundle, environments, signing_key())
    document = {"imported": report.imported, "already_present": report.already_present,
                "skipped": report.skipped, "signed": report.signed,
                "verified_signature": report.verified_signature}
    lines = [f"imported {len(report.imported)} entries, {len(report.already_present)} already present, "
             f"{len(report.skipped)} skipped"
             + ("" if report.verified_signature else " (signature not verified: no signing key set)"
                if report.signed else " (unsigned bundle)")]
    lines += [f"  skipped {key[:16]}: {why}" for key, why in report.skipped.items()]
    emit(args, document, "\n".join(lines))
    return 0


def _cache(args: argparse.Namespace) -> PersistentCache:
    """The cache directory the backend would use, opened for management (read-only stays read-only)."""
    settings = options(args)
    root = settings.cache_dir or str(default_root())
    mode = "read-only" if settings.cache_mode == "read-only" else "read-write"
    return PersistentCache(root, mode=mode, remote=settings.cache_remote,
                           remote_timeout=float(settings.cache_remote_timeout))


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


def _resolve(cache: PersistentCache, key: str) -> str:
    """A full key from a key or a unique prefix of one."""
    if is_key(key):
        return key
    matches = [k for k in cache.local.list_keys() if k.startswith(key.lower())]
    if len(matches) != 1:
        raise ValueError(f"{key!r} matches {len(matches)} cache entries; give more of the key")
    return matches[0]


def _environment(options: Options) -> dict[str, Any]:
    from tpucompile import artifacts
    from tpucompile.runtime import get_target

    return artifacts.environment(get_target(options.platform))


def _entry_target(cache: PersistentCache, key: str) -> str:
    """The target an entry was built for, read from its stored components (``?`` when they cannot be read)."""
    try:
        return target_label(read_components(cache.local.path(key)))
    except CorruptEntryError:
        return "?"
