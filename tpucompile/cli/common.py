"""What every command shares: one error type with its own exit status, ``--json`` output, the options
``--dir`` and the environment give, and the ``--target`` names."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tpucompile.config import Options
from tpucompile.targets import parse as parse_target


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
