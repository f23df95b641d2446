"""The ``tpucompile`` command (also ``python -m tpucompile``): inspect and manage the compile cache, warm it.

    tpucompile cache ls | stats | verify | prune --max-size 2GB | explain KEY_A KEY_B
    tpucompile cache export BUNDLE | import BUNDLE
    tpucompile warm SCRIPT.py [args...] [--expect-all-hits]

Every command takes ``--json``. The cache directory and mode come from ``--dir`` or the same
``TPUCOMPILE_CACHE_*`` variables the backend reads. Commands that only look at files import neither torch
nor jax, so they answer quickly.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from collections.abc import Sequence
from typing import Any

from tpucompile.cache import PersistentCache, default_root, differing_components
from tpucompile.cache.bundle import BundleError, export_bundle, import_bundle, signing_key
from tpucompile.cache.entry import CorruptEntryError, decode
from tpucompile.cache.keys import is_key
from tpucompile.config import Options, parse_size
from tpucompile.errors import TpuCompileError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except (TpuCompileError, BundleError, ValueError, OSError) as error:
        _emit(args, {"error": str(error)}, f"tpucompile: error: {error}")
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpucompile", description="tpucompile's compile cache tools")
    commands = parser.add_subparsers(title="commands")

    def command(group: Any, name: str, handler: Any, help_text: str) -> argparse.ArgumentParser:
        sub = group.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--json", action="store_true", help="print one JSON document")
        sub.add_argument("--dir", help="cache directory (default: TPUCOMPILE_CACHE_DIR or ~/.cache/tpucompile)")
        sub.set_defaults(handler=handler)
        return sub

    cache = commands.add_parser("cache", help="inspect and manage the persistent compile cache")
    cache_commands = cache.add_subparsers(title="cache commands")
    command(cache_commands, "ls", _ls, "list the entries of the local cache")
    command(cache_commands, "stats", _stats, "sizes, entry counts, hits, misses, seconds saved")
    command(cache_commands, "verify", _verify, "check every entry; quarantine corrupt ones (exit 1 if any)")
    prune = command(cache_commands, "prune", _prune, "evict the least valuable entries down to a size")
    prune.add_argument("--max-size", required=True, help="e.g. 2GB, 500MB, 1GiB")
    explain = command(cache_commands, "explain", _explain, "name the key components in which two entries differ")
    explain.add_argument("key_a")
    explain.add_argument("key_b")
    export = command(cache_commands, "export", _export, "write the local entries to one bundle file")
    export.add_argument("bundle")
    export.add_argument("--key", action="append", dest="keys", help="export only this key (repeatable)")
    imp = command(cache_commands, "import", _import, "check a bundle and add the entries that fit here")
    imp.add_argument("bundle")

    warm = command(commands, "warm", _warm, "run SCRIPT.py with the cache on; report hits, misses, time saved")
    warm.add_argument("--expect-all-hits", action="store_true", help="exit 1 if any graph had to be compiled")
    warm.add_argument("script")
    warm.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


# -- helpers --------------------------------------------------------------------------------------------


def _options(args: argparse.Namespace) -> Options:
    return Options.from_sources({"cache_dir": args.dir} if args.dir else None)


def _cache(args: argparse.Namespace) -> PersistentCache:
    """The cache directory the backend would use, opened for management (read-only stays read-only)."""
    options = _options(args)
    root = options.cache_dir or str(default_root())
    mode = "read-only" if options.cache_mode == "read-only" else "read-write"
    return PersistentCache(root, mode=mode, remote=options.cache_remote,
                           remote_timeout=float(options.cache_remote_timeout))


def _emit(args: argparse.Namespace, document: Any, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(document, indent=2, sort_keys=True, default=str))
    else:
        print(text)


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
    from tpucompile import compile_cache
    from tpucompile.runtime import get_target

    return compile_cache.environment(get_target(options.platform))


# -- cache commands -------------------------------------------------------------------------------------


def _ls(args: argparse.Namespace) -> int:
    cache = _cache(args)
    if cache.writable:
        cache.reconcile()
    rows = cache.index.rows()
    lines = [f"{'key':16}  {'kind':10}  {'size':>9}  {'compile s':>9}  {'hits':>5}  created"]
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created"]))
        lines.append(f"{row['key'][:16]}  {row['kind']:10}  {_size(row['size']):>9}  "
                     f"{row['compile_seconds']:9.3f}  {row['hits']:5d}  {created}")
    _emit(args, {"dir": str(cache.local.root), "entries": rows}, "\n".join(lines))
    return 0


def _stats(args: argparse.Namespace) -> int:
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
        "evictions": int(counters.get("evictions", 0)),
        "quarantined_total": int(counters.get("quarantined", 0)),
        "in_quarantine": len(quarantined),
    }
    text = "\n".join([
        f"cache {document['dir']}: {document['entries']} entries, {_size(document['bytes'])}",
        *(f"  {kind}: {v['entries']} entries, {_size(v['bytes'])}" for kind, v in sorted(by_kind.items())),
        f"  hits {document['hits']}, misses {document['misses']}, "
        f"{document['seconds_saved']:.1f} s of compiling saved",
        f"  evictions {document['evictions']}, quarantined {document['quarantined_total']} "
        f"({document['in_quarantine']} files in quarantine)",
    ])
    _emit(args, document, text)
    return 0


def _verify(args: argparse.Namespace) -> int:
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
    _emit(args, {"ok": ok, "corrupt": corrupt, "index": reconciled}, "\n".join(lines))
    return 1 if corrupt else 0


def _prune(args: argparse.Namespace) -> int:
    cache = _cache(args)
    limit = parse_size(args.max_size)
    reconciled = cache.reconcile()
    before = cache.index.total_size()
    evicted = cache.prune(limit)
    after = cache.index.total_size()
    document = {"max_size": limit, "bytes_before": before, "bytes_after": after,
                "evicted": [k for k, _ in evicted], "index": reconciled}
    _emit(args, document, f"evicted {len(evicted)} entries: {_size(before)} -> {_size(after)} "
          f"(cap {_size(limit)})")
    return 0


def _explain(args: argparse.Namespace) -> int:
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
    _emit(args, {"a": first.key, "b": second.key, "differing": differing, "details": details}, "\n".join(lines))
    return 0


def _clip(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _export(args: argparse.Namespace) -> int:
    cache = _cache(args)
    keys = [_resolve(cache, k) for k in args.keys] if args.keys else None
    key = signing_key()
    manifest = export_bundle(cache, args.bundle, _environment(_options(args)), keys, key)
    count = len(manifest["entries"])
    _emit(args, {"bundle": args.bundle, "entries": count, "signed": key is not None},
          f"exported {count} entries to {args.bundle} ({'signed' if key else 'unsigned'})")
    return 0


def _import(args: argparse.Namespace) -> int:
    cache = _cache(args)
    report = import_bundle(cache, args.bundle, _environment(_options(args)), signing_key())
    document = {"imported": report.imported, "already_present": report.already_present,
                "skipped": report.skipped, "signed": report.signed,
                "verified_signature": report.verified_signature}
    lines = [f"imported {len(report.imported)} entries, {len(report.already_present)} already present, "
             f"{len(report.skipped)} skipped"
             + ("" if report.verified_signature else " (signature not verified: no signing key set)"
                if report.signed else " (unsigned bundle)")]
    lines += [f"  skipped {key[:16]}: {why}" for key, why in report.skipped.items()]
    _emit(args, document, "\n".join(lines))
    return 0


# -- warm -----------------------------------------------------------------------------------------------


def _warm(args: argparse.Namespace) -> int:
    if args.dir:
        os.environ["TPUCOMPILE_CACHE_DIR"] = args.dir
    if os.environ.get("TPUCOMPILE_CACHE_MODE", "") in ("off", ""):
        os.environ["TPUCOMPILE_CACHE_MODE"] = "read-write"
    from tpucompile import driver

    events: list[Any] = []
    remove = driver.add_observer(events.append)
    status = 0
    start = time.perf_counter()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        remove()
    seconds = time.perf_counter() - start
    hits = [e for e in events if e.cache_hit]
    misses = [e for e in events if not e.cache_hit]
    tiers = {tier: sum(1 for e in hits if e.tier == tier) for tier in ("memory", "local", "remote")}
    document = {
        "graphs": len(events),
        "hits": len(hits),
        "hits_by_tier": tiers,
        "misses": len(misses),
        "missed": [e.name for e in misses],
        "lowering_skipped": sum(1 for e in events if e.program_tier is not None),
        "seconds_saved": round(sum(e.saved_seconds for e in hits), 3),
        "seconds_compiling": round(sum(e.compile_seconds for e in misses), 3),
        "wall_seconds": round(seconds, 3),
        "script_status": status,
    }
    text = (f"tpucompile warm: {len(events)} graphs, {len(hits)} hits "
            f"({', '.join(f'{n} {t}' for t, n in tiers.items() if n) or 'none'}), {len(misses)} misses, "
            f"{document['seconds_saved']:.2f} s saved, {document['seconds_compiling']:.2f} s compiling")
    _emit(args, document, text)
    if status:
        return status
    if args.expect_all_hits and misses:
        print(f"tpucompile warm: --expect-all-hits, but compiled: {', '.join(e.name for e in misses)}",
              file=sys.stderr)
        return 1
    return 0
