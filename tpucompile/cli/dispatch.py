"""The command line's parser, and the dispatch from a parsed command to its handler: a handler's return
value is the exit status; a ``Failure`` prints one line and exits with its own status, other expected errors
print one line (or a JSON document) and exit 1."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from tpucompile.cache.bundle import BundleError
from tpucompile.cli import cache_commands, dump_hlo, export_command, warm
from tpucompile.cli.common import Failure, emit
from tpucompile.cli.dump_hlo import (
    EXIT_NO_SCRIPT,
    EXIT_NO_SUCH_GRAPH,
    EXIT_NOTHING_COMPILED,
    EXIT_OUT_NOT_WRITABLE,
    EXIT_SCRIPT_FAILED,
    EXIT_TARGET_FAILED,
    EXIT_UNKNOWN_KEY,
)
from tpucompile.debug.layout import DEFAULT_DIR, ENV_VAR, STAGES
from tpucompile.errors import TpuCompileError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if argv[:1] in (["dump-hlo"], ["export"]) and "--" in argv:  # everything after "--" belongs to the script
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
    except Failure as failure:
        print(f"tpucompile {args.command}: {failure}", file=sys.stderr)
        return failure.status
    except (TpuCompileError, BundleError, ValueError, OSError) as error:
        emit(args, {"error": str(error)}, f"tpucompile: error: {error}")
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
  {ENV_VAR}=/tmp/d python train.py     the same dump from any program, without this command

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


def build_parser() -> argparse.ArgumentParser:
    """Every command, its flags and its help; each command's handler is in ``args.handler``."""
    parser = argparse.ArgumentParser(prog="tpucompile",
                                     description="see what tpucompile made of a program; manage its compile cache")
    commands = parser.add_subparsers(title="commands", dest="command")

    def command(group: Any, name: str, handler: Any, help_text: str, **extra: Any) -> argparse.ArgumentParser:
        sub = group.add_parser(name, help=help_text, description=help_text, **extra)
        sub.add_argument("--json", action="store_true", help="print one JSON document")
        sub.add_argument("--dir", help="cache directory (default: TPUCOMPILE_CACHE_DIR or ~/.cache/tpucompile)")
        sub.set_defaults(handler=handler)
        return sub

    dump_parser = command(
        commands, "dump-hlo", dump_hlo.dump_hlo,
        "run SCRIPT.py unchanged and write down what each graph it compiles with tpucompile became:\n"
        "the FX graph, the ATen graph after each pass, StableHLO, XLA HLO before and after optimisation,\n"
        "compile options, cache key, compile time and cache outcome",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_DUMP_HLO_EPILOG,
    )
    dump_parser.add_argument("script", nargs="?", help="the program to run (omit it to read the last dump)")
    dump_parser.add_argument("--out", default=os.environ.get(ENV_VAR) or DEFAULT_DIR, metavar="DIR",
                             help=f"dump directory (default: ${ENV_VAR} or ./{DEFAULT_DIR})")
    dump_parser.add_argument("--stage", choices=list(STAGES),
                             help="with --graph: print this stage (default stablehlo)")
    dump_parser.add_argument("--graph", type=int, metavar="N", help="print one stage of graph N to stdout")
    dump_parser.add_argument("--key", metavar="KEY",
                             help="print the StableHLO stored for a cache key (or a unique prefix of one)")
    dump_parser.add_argument("--diff", nargs=2, metavar=("KEY_A", "KEY_B"),
                             help="unified diff of two keys' StableHLO, without locations (what keys hash)")
    dump_parser.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                             help="also compile every graph for TARGET (repeatable; e.g. tpu:v5e:2x2, no TPU "
                                  "needed): its optimised HLO, memory per chip, flops, whether it fits; with "
                                  "--graph, print that target's stage")
    dump_parser.set_defaults(script_args=[])

    cache = commands.add_parser("cache", help="inspect and manage the persistent compile cache")
    cache_group = cache.add_subparsers(title="cache commands")
    ls = command(cache_group, "ls", cache_commands.ls,
                 "list the entries of the local cache, with the target each is for")
    ls.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                    help="only entries built for TARGET (tpu:v5e:2x2, cpu; repeatable)")
    command(cache_group, "stats", cache_commands.stats, "sizes, entry counts, hits, misses, seconds saved")
    command(cache_group, "verify", cache_commands.verify, "check every entry; quarantine corrupt ones (exit 1 if any)")
    prune = command(cache_group, "prune", cache_commands.prune, "evict the least valuable entries down to a size")
    prune.add_argument("--max-size", required=True, help="e.g. 2GB, 500MB, 1GiB")
    explain = command(cache_group, "explain", cache_commands.explain,
                      "name the key components in which two entries differ")
    explain.add_argument("key_a")
    explain.add_argument("key_b")
    export = command(cache_group, "export", cache_commands.export, "write the local entries to one bundle file")
    export.add_argument("bundle")
    export.add_argument("--key", action="append", dest="keys", help="export only this key (repeatable)")
    export.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                        help="export only entries built for TARGET (repeatable)")
    imp = command(cache_group, "import", cache_commands.import_, "check a bundle and add the entries that fit here")
    imp.add_argument("bundle")
    imp.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                     help="also accept entries built for compile-only TARGET (e.g. to re-export them)")

    warm_parser = command(commands, "warm", warm.warm,
                          "run SCRIPT.py with the cache on; report hits, misses, time saved")
    warm_parser.add_argument("--expect-all-hits", action="store_true", help="exit 1 if any graph had to be compiled")
    warm_parser.add_argument("--target", action="append", dest="targets", metavar="TARGET",
                             help="also compile every graph for TARGET and store it (repeatable; e.g. tpu:v5e:2x2, "
                                  "compiled without a TPU, for `cache export` to the TPU hosts)")
    warm_parser.add_argument("--buckets", metavar="SIZES",
                             help="compile graphs with changing sizes per bucket (dynamic_mode=bucket with these "
                                  "buckets, e.g. 64,256,1024) and, after the script, every bucket of every such "
                                  "graph, so that no size up to the largest compiles again")
    warm_parser.add_argument("script")
    warm_parser.add_argument("script_args", nargs=argparse.REMAINDER)

    export_parser = command(
        commands, "export", export_command.export,
        "export the model SCRIPT.py describes (its function export_model() returns (model, example_args[,\n"
        "dynamic_shapes]) or a dict with those keys and buckets) to a directory served without torch:\n"
        "StableHLO programs in jax.export's serialisation, safetensors weights, manifest.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit status: 0 ok, 1 other error, 2 bad command line, 3 no such script, 4 the script failed,\n"
               "  10 no such function (or it returned something else), 11 the model cannot be exported (the\n"
               "  message names the op and your source line)",
    )
    export_parser.add_argument("script")
    export_parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    export_parser.add_argument("--function", default="export_model", metavar="NAME",
                               help="the script's function returning the model and its example inputs "
                                    "(default export_model)")
    export_parser.add_argument("--buckets", metavar="SIZES",
                               help="sizes to make programs for along every dynamic dimension, e.g. 8,32")
    export_parser.set_defaults(script_args=[])
    return parser
