"""``tpucompile export SCRIPT.py --out DIR``: export the model a script defines, for serving without torch.

The script is loaded as a module (run under the name ``__tpucompile_export__``, so its
``if __name__ == "__main__":`` block does not run) and the function named by ``--function`` (default
``export_model``) is called with no arguments. It returns ``(model, example_args)``,
``(model, example_args, dynamic_shapes)``, or a dict with the keys ``model``, ``example_args`` and optionally
``dynamic_shapes`` and ``buckets`` (the arguments of ``tpucompile.export``). ``--buckets 8,32`` sets the
buckets of every dynamic dimension.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Mapping
from typing import Any

from tpucompile.cli.common import Failure, emit
from tpucompile.cli.script import print_script_traceback

EXIT_NO_SCRIPT = 3
EXIT_SCRIPT_FAILED = 4
EXIT_NO_FUNCTION = 10
EXIT_REFUSED = 11
"""The model holds something an exported program cannot run (the message names the op and the source line)."""


def export(args: argparse.Namespace) -> int:
    """Load the script, call its function, export what it returns to ``--out``; print a summary."""
    if not os.path.isfile(args.script):
        raise Failure(EXIT_NO_SCRIPT, f"no such script: {args.script}")
    described = _described_model(args)
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else described.get("buckets")
    from tpucompile.errors import UnsupportedOpError
    from tpucompile.exporting import writer

    try:
        manifest = writer.export(described["model"], described["example_args"], args.out,
                                 described.get("dynamic_shapes"), buckets)
    except UnsupportedOpError as error:
        raise Failure(EXIT_REFUSED, str(error)) from None
    user = [i for i in manifest["inputs"] if i["kind"] == "user_input"]
    weights = sum(1 for i in manifest["inputs"] if i["kind"] == "weight")
    lines = [f"exported to {args.out}: {len(manifest['programs'])} program(s), {weights} weights",
             *(f"  input  {i['name']}: {i['dtype']}{i['shape']}" for i in user),
             *(f"  output {o['name']}: {o['dtype']}{o['shape']}" for o in manifest["outputs"]),
             *(f"  {p['file']} serves sizes up to {p['sizes']}" for p in manifest["programs"] if p["sizes"])]
    emit(args, manifest, "\n".join(lines))
    return 0


def _described_model(args: argparse.Namespace) -> Mapping[str, Any]:
    """What the script's function returns, as a dict with ``model`` and ``example_args``."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        namespace = runpy.run_path(args.script, run_name="__tpucompile_export__")
        function = namespace.get(args.function)
        if not callable(function):
            raise Failure(EXIT_NO_FUNCTION, f"{args.script} defines no function {args.function}() returning the "
                                            "model and its example inputs")
        described = function()
    except Failure:
        raise
    except Exception as error:
        print_script_traceback(error, args.script)
        raise Failure(EXIT_SCRIPT_FAILED, f"{args.script} raised {type(error).__name__}: {error}") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    if isinstance(described, (tuple, list)) and len(described) in (2, 3):
        described = dict(zip(("model", "example_args", "dynamic_shapes"), described, strict=False))
    if not isinstance(described, Mapping) or "model" not in described or "example_args" not in described:
        raise Failure(EXIT_NO_FUNCTION, f"{args.function}() must return (model, example_args[, dynamic_shapes]) or "
                                        "a dict with model and example_args")
    return described
