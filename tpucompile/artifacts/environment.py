"""What about this machine and software changes compiled code: the ``environment`` part of every key."""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import torch

from tpucompile import __version__
from tpucompile.cache import digest
from tpucompile.runtime import Target, build_flags

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent
_SOURCE_SUFFIXES = (".py", ".c")


@functools.cache
def package_digest(root: pathlib.Path = _PACKAGE) -> str:
    """SHA-256 over every ``.py`` and ``.c`` file of the package under ``root`` (relative paths and contents).

    Any of them can change what is compiled (a pass, a lowering rule, the decomposition table, a CPU rewrite
    applied after the key is computed, the runner of a cached plan), so all of them are hashed, as Inductor
    hashes torch's tree; the version string alone would keep serving executables built by older code."""
    parts = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()):
        if "__pycache__" in path.parts:
            continue
        parts.append(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest(b"\0\0".join(parts))


def environment(target: Target) -> dict[str, Any]:
    """Everything about this machine and software that changes compiled code (``ENVIRONMENT_COMPONENTS``):
    the target's platform and devices, XLA's flags, tpucompile's version and source digest, and torch's
    version (its decomposition tables and shape rules shape the graphs)."""
    return {
        **target.describe(),
        "xla_flags": build_flags(platform=target.platform),
        "tpucompile": __version__,
        "tpucompile_sources": package_digest(),
        "torch": torch.__version__,
    }
