"""The ``tpucompile`` command (also ``python -m tpucompile``): see what graphs became, manage the compile cache.

    tpucompile dump-hlo SCRIPT.py [--out DIR] [--target tpu:v5e:2x2] [--stage STAGE --graph N] [-- script args...]
    tpucompile dump-hlo --key KEY | --diff KEY_A KEY_B
    tpucompile cache ls [--target T] | stats | verify | prune --max-size 2GB | explain KEY_A KEY_B
    tpucompile cache export BUNDLE [--target T] | import BUNDLE [--target T]
    tpucompile warm [--target tpu:v5e:2x2 ...] SCRIPT.py [args...] [--expect-all-hits]
    tpucompile export SCRIPT.py --out DIR [--function export_model] [--buckets 8,32] [-- script args...]

``--target`` names a compile-only target (a TPU slice by topology, compiled for without a TPU): every graph
is also compiled for it and stored in the cache under the key a host of that slice computes.

Every command takes ``--json``. The cache directory and mode come from ``--dir`` or the same
``TPUCOMPILE_CACHE_*`` variables the backend reads. Commands that only look at files import neither torch
nor jax (``dump-hlo --key/--diff`` load only jax's MLIR bindings), so they answer quickly.

    dispatch        the argument parser, and from a parsed command to its handler and exit status
    cache_commands  ``cache ls|stats|verify|prune|explain|export|import``
    warm            ``warm``: run a script with the cache on, report hits and misses
    dump_hlo        ``dump-hlo``: run a script with a dump active, print the dump, stored programs, diffs
    export_command  ``export``: export the model a script describes, for serving without torch
    script          running the user's script in this process, with the command's settings in force
    common          what every command shares: ``--json`` output, options from ``--dir``, ``--target`` names
"""

from tpucompile.cli.dispatch import main
from tpucompile.cli.dump_hlo import (
    EXIT_NO_SCRIPT,
    EXIT_NO_SUCH_GRAPH,
    EXIT_NOTHING_COMPILED,
    EXIT_OUT_NOT_WRITABLE,
    EXIT_SCRIPT_FAILED,
    EXIT_TARGET_FAILED,
    EXIT_UNKNOWN_KEY,
)

__all__ = [
    "EXIT_NOTHING_COMPILED",
    "EXIT_NO_SCRIPT",
    "EXIT_NO_SUCH_GRAPH",
    "EXIT_OUT_NOT_WRITABLE",
    "EXIT_SCRIPT_FAILED",
    "EXIT_TARGET_FAILED",
    "EXIT_UNKNOWN_KEY",
    "main",
]
