"""The ``tpucompile`` command (also ``python -m tpucompile``): see what graphs became, manage the compile cache.

    tpucompile dump-hlo SCRIPT.py [--out DIR] [--target tpu:v5e:2x2] [--stage STAGE --graph N] [-- script args...]
    tpucompile dump-hlo --key KEY | --diff KEY_A KEY_B
    tpucompile cache ls [--target T] | stats | verify | prune --max-size 2GB | explain KEY_A KEY_B
    tpucompile cache export BUNDLE [--target T] | import BUNDLE [--target T]
    tpucompile warm [--target tpu:v5e:2x2 ...] SCRIPT.py [args...] [--expect-all-hits]

``--target`` names a compile-only target (a TPU slice by topology, compiled for without a TPU): every graph
is also compiled for it and stored in the cache under the key a host of that slice computes.

Every command takes ``--json``. The cache directory and mode come from ``--dir`` or the same
``TPUCOMPILE_CACHE_*`` variables the backend reads. Commands that only look at files import neither torch
nor jax (``dump-hlo --key/--diff`` load only jax's MLIR bindings), so they answer quickly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from tpucompile import dump
from tpucompile.cache import PersistentCache, default_root, differing_components
from tpucompile.cache.bundle import BundleError, export_bundle, import_bundle, signing_key
from tpucompile.cache.entry import CorruptEntryError, decode, read_components
from tpucompile.cache.keys import is_key
from tpucompile.config import Options, parse_size
from tpucompile.errors import TpuCompileError
from tpucompile.targets import label as target_label
from tpucompile.targets import parse as parse_target

# Exit statuses of ``dump-hlo`` (besides 0, 1 for other errors and 2 for a malformed command line).
EXIT_NO_SCRIPT = 3
EXIT_SCRIPT_FAILED = 4
EXIT_NOTHING_COMPILED = 5
EXIT_UNKNOWN_KEY = 6
EXIT_OUT_NOT_WRITABLE = 7
EXIT_NO_SUCH_GRAPH = 8
EXIT_TARGET_FAILED = 9


class _Failure(Exception):
    """A one-line error with an exit status of its own, so that scripts can tell the cases apart."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if argv[:1] == ["dump-hlo"] and "--" in argv:  # everything after "--" belongs to the script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    if script_args:
        args.script_args = script_args
    try:
        return args.handler(args)
    except BrokenPipeError:  # the reader (head, grep -q) stopped early: not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except _Failure as failure:
        print(f"tpucompile {args.command}: {failure}", file=sys.stderr)
        return failure.status
    except (TpuCompileError, BundleError, ValueError, OSError) as error:
        _emit(args, {"error": str(error)}, f"tpucompile: error: {error}")
        return 1


_DUMP_HLO_EPILOG = f"""\
examples:
  tpucompile dump-hlo examples/mlp.py               run it, dump every graph, print a summary table
  tpucompile dump-hlo --stage stablehlo --graph 1 | grep dot_general
                                                    print one stage of one graph of the last dump
  tpucompile dump-hlo train.py --out /tmp/d -- --steps 2
                                                    arguments after "--" are the script's
  tpucompile dump-hlo --key cbe2f006                the StableHLO stored in the cache for a key (prefix)
  tpucompile dump-hlo --diff 98fbe0e8 cbe2f006      why did it recompile? a diff of two keys' StableHLO
  tpucompile dump-hlo --target tpu:v5e:2x2 train.py will it fit a v5e-4? each graph compiled for that TPU
                                                    slice (no TPU needed): memory per chip, flops, TPU HLO
  tpucompile dump-hlo --target tpu:v5e:2x2 --stage optimized --graph 1
                                                    the optimised TPU HLO of graph 1
  {dump.ENV_VAR}=/tmp/d python train.py     the same dump from any program, without this command

summary of examples/mlp.py (on stdout; the script's own output goes to stderr):
  graph  role       aten ops  hlo ops  in/out  shapes                              key           compile ms  cache
      0  inference        18       28  11/1    f32[256,256] +10 -> f32[64,10]      98fbe0e8b18c       112.5  miss
      1  forward          18       28  11/13   f32[256,256] +10 -> f32[64,10] +12  cbe2f006e72a       159.8  miss
      2  backward         62       85  14/10   f32[64,256] +13 -> f32[256,256] +9  5f80fe47ff67       107.7  miss

each graph gets a folder DIR/NNN-ROLE, numbered in compile order (a new run replaces the old folders):
  fx.txt               Dynamo's FX graph
  aten_N_<stage>.txt   the ATen graph from AOTAutograd, then after each pass
  aten.txt             the ATen graph that was lowered; locations.txt: each op's line in your source
  stablehlo.mlir       StableHLO text, loc("file.py":line:col) on each op (keys ignore locations)
  stablehlo.mlirbc     the same as a portable StableHLO artifact
  hlo.txt              XLA HLO before optimisation; hlo_optimized.txt: HLO of the compiled executable
  compile_options.txt  XLA compile options; key.json: the cache key and its components
  info.json            op counts, signature, compile time, cache outcome, fallback ops, source files
  targets/T/           per --target: its StableHLO, optimised HLO, compile options, key, report.json

exit status:
  0 ok, 1 other error, 2 bad command line, {EXIT_NO_SCRIPT} no such script, \
{EXIT_SCRIPT_FAILED} the script failed (dumps made so far are kept),
  {EXIT_NOTHING_COMPILED} the script compiled nothing, {EXIT_UNKNOWN_KEY} unknown key, \
{EXIT_OUT_NOT_WRITABLE} --out is not writable, {EXIT_NO_SUCH_GRAPH} no such graph or stage in the dump,
  {EXIT_TARGET_FAILED} a graph does not fit or does not compile for a --target (the summary says which and why)
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpucompile",
                                     description="see what tpucompile made of a program; manage its compile cache")
    commands = parser.add_subparsers(title="commands", dest="command")

    def command(group: Any, name: str, handler: Any, help_text: str, **extra: Any) -> argparse.ArgumentParser:
        sub = group.add_parser(name, help=help_text, description=help_text, **extra)
        sub.add_argument("--json", action="store_true", help="print one JSON document")
        sub.add_argument("--dir", help="cache directory (default: TPUCOMPILE_CACHE_DIR or ~/.cache/tpucompile)")
        sub.set_defaults(handler=handler)
        return sub

    dump_hlo = command(
        commands, "dump-hlo", _dump_hlo,
        "run SCRIPT.py unchanged and write down what each graph it compiles with tpucompile became:\n"
        "the FX graph, the ATen graph after each pass, StableHLO, XLA HLO before and after optimisation,\n"
        "compile options, cache key, compile time and cache outcome",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_DUMP_HLO_EPILOG,
    )
    dump_hlo.add_argument("script", nargs="?", help="the program to run (omit it to read the last dump)")
    dump_hlo.add_argument("--out", default=os.environ.get(dump.ENV_VAR) or dump.DEFAULT_DIR, metavar="DIR",
                          help=f"dump directory (default: ${dump.ENV_VAR} or ./{dump.DEFAULT_DIR})")
    dump_hlo.add_argument("--stage", choices=list(dump.STAGES),
                          help="with --graph: print this stage (default stablehlo)")
    dump_hlo.add_argument("--graph", type=int, metavar="N", help="print one stage of graph N to stdout")
    dump_hlo.add_argument("--key", metavar="KEY",
                          help="print the StableHLO stored for a cache key (or a unique prefix of one)")
    dump_hlo.add_argument("--diff", nargs=2, metavar=("KEY_A", "KEY_B"),
                          help="unified diff of two keys' StableHLO, without locations (what keys hash)")
    dump_hlo.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                          help="also compile every graph for TARGET (repeatable; e.g. tpu:v5e:2x2, no TPU "
                               "needed): its optimised HLO, memory per chip, flops, whether it fits; with "
                               "--graph, print that target's stage")
    dump_hlo.set_defaults(script_args=[])

    cache = commands.add_parser("cache", help="inspect and manage the persistent compile cache")
    cache_commands = cache.add_subparsers(title="cache commands")
    ls = command(cache_commands, "ls", _ls, "list the entries of the local cache, with the target each is for")
    ls.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                    help="only entries built for TARGET (tpu:v5e:2x2, cpu; repeatable)")
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
    export.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                        help="export only entries built for TARGET (repeatable)")
    imp = command(cache_commands, "import", _import, "check a bundle and add the entries that fit here")
    imp.add_argument("bundle")
    imp.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                     help="also accept entries built for compile-only TARGET (e.g. to re-export them)")

    warm = command(commands, "warm", _warm, "run SCRIPT.py with the cache on; report hits, misses, time saved")
    warm.add_argument("--expect-all-hits", action="store_true", help="exit 1 if any graph had to be compiled")
    warm.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                      help="also compile every graph for TARGET and store it (repeatable; e.g. tpu:v5e:2x2, "
                           "compiled without a TPU, for `cache export` to the TPU hosts)")
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


def _target_names(args: argparse.Namespace) -> list[str]:
    """The ``--target`` names, checked and in their canonical spelling."""
    return list(dict.fromkeys(str(parse_target(name)) for name in getattr(args, "targets", None) or []))


def _use_targets(args: argparse.Namespace) -> list[str]:
    """Have every graph the script compiles also compiled for ``--target``: checked now (a missing libtpu or
    an unknown topology fails before the script runs), passed on through ``TPUCOMPILE_TARGETS``."""
    names = _target_names(args)
    if names:
        from tpucompile.runtime.topology import compile_targets

        compile_targets(tuple(names), _options(args).platform)
        present = [n for n in os.environ.get("TPUCOMPILE_TARGETS", "").split(",") if n.strip()]
        os.environ["TPUCOMPILE_TARGETS"] = ",".join(dict.fromkeys([*present, *names]))
    return names


def _entry_target(cache: PersistentCache, key: str) -> str:
    """The target an entry was built for, read from its stored components (``?`` when they cannot be read)."""
    try:
        return target_label(read_components(cache.local.path(key)))
    except CorruptEntryError:
        return "?"


# -- cache commands -------------------------------------------------------------------------------------


def _ls(args: argparse.Namespace) -> int:
    cache = _cache(args)
    if cache.writable:
        cache.reconcile()
    rows = cache.index.rows()
    for row in rows:
        row["target"] = _entry_target(cache, row["key"])
    wanted = _target_names(args)
    if wanted:
        rows = [row for row in rows if row["target"] in wanted]
    width = max([len("target"), *(len(row["target"]) for row in rows)])
    lines = [f"{'key':16}  {'kind':10}  {'target':{width}}  {'size':>9}  {'compile s':>9}  {'hits':>5}  created"]
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["created"]))
        lines.append(f"{row['key'][:16]}  {row['kind']:10}  {row['target']:{width}}  {_size(row['size']):>9}  "
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
    wanted = _target_names(args)
    if wanted:
        keys = [k for k in (keys if keys is not None else cache.local.list_keys()) if _entry_target(cache, k) in wanted]
    key = signing_key()
    manifest = export_bundle(cache, args.bundle, _environment(_options(args)), keys, key)
    count = len(manifest["entries"])
    _emit(args, {"bundle": args.bundle, "entries": count, "signed": key is not None},
          f"exported {count} entries to {args.bundle} ({'signed' if key else 'unsigned'})")
    return 0


def _import(args: argparse.Namespace) -> int:
    cache = _cache(args)
    environments = [_environment(_options(args))]
    if _target_names(args):
        from tpucompile import compile_cache
        from tpucompile.runtime.topology import compile_targets

        environments += [compile_cache.environment(t) for t in compile_targets(tuple(_target_names(args)))]
    report = import_bundle(cache, args.bundle, environments, signing_key())
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
    targets = _use_targets(args)
    from tpucompile import driver

    events: list[Any] = []
    remove = driver.add_observer(events.append)
    start = time.perf_counter()
    try:
        status = _run_script(args.script, args.script_args)
    finally:
        remove()
    seconds = time.perf_counter() - start
    target_events = [e for e in events if e.target is not None]
    events = [e for e in events if e.target is None]
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
        "targets": {name: _target_report([e for e in target_events if e.target == name]) for name in targets},
    }
    text = (f"tpucompile warm: {len(events)} graphs, {len(hits)} hits "
            f"({', '.join(f'{n} {t}' for t, n in tiers.items() if n) or 'none'}), {len(misses)} misses, "
            f"{document['seconds_saved']:.2f} s saved, {document['seconds_compiling']:.2f} s compiling")
    for name, report in document["targets"].items():
        text += (f"\n  {name}: {report['graphs']} graphs, {report['hits']} from the cache, {report['compiled']} "
                 f"compiled and stored ({report['seconds_compiling']:.2f} s), {len(report['failed'])} failed")
    _emit(args, document, text)
    if status:
        return status
    failed = [e for e in target_events if e.error is not None]
    for event in failed:
        print(f"tpucompile warm: {event.error}", file=sys.stderr)
    if failed:
        return 1
    compiled = misses + [e for e in target_events if not e.cache_hit]
    if args.expect_all_hits and compiled:
        names = [e.name + (f" for {e.target}" if e.target else "") for e in compiled]
        print(f"tpucompile warm: --expect-all-hits, but compiled: {', '.join(names)}", file=sys.stderr)
        return 1
    return 0


def _target_report(events: list[Any]) -> dict[str, Any]:
    compiled = [e for e in events if not e.cache_hit and e.error is None]
    return {
        "graphs": len(events),
        "hits": sum(1 for e in events if e.cache_hit),
        "compiled": len(compiled),
        "failed": {e.name: e.error for e in events if e.error is not None},
        "seconds_compiling": round(sum(e.compile_seconds for e in compiled), 3),
        "keys": [e.key for e in events if e.key],
    }


def _run_script(script: str, script_args: Sequence[str]) -> int:
    """Run ``script`` as ``__main__`` in this process (so that its compiles can be observed); returns the
    status it exited with. Exceptions it raises propagate."""
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)  # paths given on the command line stay valid after the run
    return 0


# -- dump-hlo -------------------------------------------------------------------------------------------


def _dump_hlo(args: argparse.Namespace) -> int:
    if (args.key or args.diff) and (args.script or args.graph is not None):
        raise _Failure(2, "--key and --diff read stored programs; they take no script and no --graph")
    if args.key or args.diff:
        return _dump_keys(args)
    if args.script:
        _dump_script(args)
    targets = _target_names(args)
    if args.graph is not None:
        if len(targets) > 1:
            raise _Failure(2, "--graph prints one stage of one target: give at most one --target")
        try:
            sys.stdout.write(dump.stage_text(args.out, args.graph, args.stage or "stablehlo",
                                             targets[0] if targets else None))
        except LookupError as error:
            raise _Failure(EXIT_NO_SUCH_GRAPH, str(error)) from None
        return 0
    infos = dump.read_dump(args.out)
    if not infos:
        raise _Failure(EXIT_NO_SUCH_GRAPH, f"no dump in {args.out} (make one with: tpucompile dump-hlo SCRIPT.py)")
    text = (f"{len(infos)} graph{'s' if len(infos) != 1 else ''} dumped to {args.out} "
            f"(--stage {'|'.join(dump.STAGES)} --graph N prints one)\n{dump.format_summary(infos)}")
    _emit(args, {"dir": args.out, "graphs": infos}, text)
    failed = [(info, name, report) for info in infos for name, report in info.get("targets", {}).items()
              if report.get("error") and (not targets or name in targets)]
    if failed:
        info, name, report = failed[0]
        more = f" (and {len(failed) - 1} more, listed above)" if len(failed) > 1 else ""
        verb = "does not fit" if report.get("fits") is False else "does not compile for"
        raise _Failure(EXIT_TARGET_FAILED, f"graph {info['graph']} ({info['role']}) {verb} {name}{more}: "
                                           f"{report['error']}")
    return 0


def _dump_script(args: argparse.Namespace) -> None:
    """Run the script with a dump active, and fail with the matching status when that went wrong."""
    script = args.script
    if not os.path.isfile(script):
        raise _Failure(EXIT_NO_SCRIPT, f"no such script: {script}")
    if args.dir:
        os.environ["TPUCOMPILE_CACHE_DIR"] = args.dir
    _use_targets(args)
    try:
        recorder = dump.start(args.out)
    except OSError as error:
        raise _Failure(EXIT_OUT_NOT_WRITABLE, f"cannot write the dump to {args.out}: "
                                              f"{error.strerror or error}") from None
    try:
        with _stdout_to_stderr():
            status = _run_script(script, args.script_args)
    except Exception as error:
        _print_script_traceback(error, script)
        raise _Failure(EXIT_SCRIPT_FAILED, f"{script} raised {type(error).__name__}: {_first_line(error)}; "
                                           f"{_kept(recorder.count, args.out)}") from None
    finally:
        dump.stop()
    if status:
        raise _Failure(EXIT_SCRIPT_FAILED, f"{script} exited with status {status}; "
                                           f"{_kept(recorder.count, args.out)}")
    if recorder.count == 0:
        raise _Failure(EXIT_NOTHING_COMPILED, f"{script} compiled nothing with backend=\"tpucompile\": "
                                              "no graph to dump")


def _kept(count: int, out: str) -> str:
    return f"{count} graph{'s' if count != 1 else ''} dumped before that, kept in {out}"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what the script prints to stderr (file descriptor and all), so stdout carries only the dump."""
    sys.stdout.flush()
    try:
        saved: int | None = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no usable descriptors (an embedded interpreter): redirect Python's writes only
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _print_script_traceback(error: BaseException, script: str) -> None:
    """The script's traceback from its own first frame on (runpy and this command are not the user's)."""
    tb = error.__traceback__
    path = os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb, file=sys.stderr)


def _dump_keys(args: argparse.Namespace) -> int:
    """``--key``: one stored program; ``--diff``: how two differ."""
    options = _options(args)
    root = options.cache_dir or str(default_root())
    cache = PersistentCache(root, mode="read-only", remote=options.cache_remote,
                            remote_timeout=float(options.cache_remote_timeout))
    try:
        programs = [dump.stored_program(key, cache, args.out) for key in (args.diff or [args.key])]
    except LookupError as error:
        raise _Failure(EXIT_UNKNOWN_KEY, str(error)) from None
    if args.key:
        (program,) = programs
        _emit(args, {"key": program.key, "source": program.source, "stablehlo": program.text}, program.text.rstrip())
        return 0
    diff = dump.diff_programs(*programs)
    _emit(args, {"a": programs[0].key, "b": programs[1].key, "diff": diff}, diff.rstrip())
    return 0
