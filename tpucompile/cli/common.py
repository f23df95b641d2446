"""What every command shares: one error type with its own exit status, ``--json`` output, the options
``--dir`` and the environment give, and the ``--target`` names."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from tpucompile.config import Options
from tpucompile.contracts.target_names import parse as parse_target


class Failure(Exception):
    """A one-line error with an exit status of its own, so that scripts can tell the cases apart."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def emit(args: argparse.Namespace, document: Any, text: str) -> None:
    """Print ``document`` as JSON under ``--json``, else ``text``."""
    if getattr(args, "json", False):
        print(json.dumps(document, indent=2, sort_keys=True, default=str))
    else:
        print(text)


def options(args: argparse.Namespace) -> Options:
    """The options the backend would read, with ``--dir`` as the cache directory."""
    return Options.from_sources({"cache_dir": args.dir} if args.dir else None)


def target_names(args: argparse.Namespace) -> list[str]:
    """The ``--target`` names, checked and in their canonical spelling."""
    return list(dict.fromkeys(str(parse_target(name)) for name in getattr(args, "targets", None) or []))


def progress_lines(args: argparse.Namespace) -> Callable[[Any], None] | None:
    """An observer printing one line per compiled graph to a terminal's stderr (what it was compiled for, how
    long it took, time since the command started): a TPU compile of a large graph takes minutes. None when
    stderr is not a terminal or ``--json`` asks for one document."""
    if getattr(args, "json", False) or not sys.stderr.isatty():
        return None
    start, count = time.perf_counter(), 0

    def line(event: Any) -> None:
        nonlocal count
        count += 1
        where = event.target or "this machine"
        outcome = ("failed" if event.error is not None else "from the cache" if event.cache_hit
                   else f"compiled in {event.compile_seconds:.1f} s")
        print(f"tpucompile: {count}: {event.name} for {where}: {outcome} ({time.perf_counter() - start:.0f} s "
              "elapsed)", file=sys.stderr, flush=True)

    return line
