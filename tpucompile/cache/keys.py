"""Content-addressed cache keys: SHA-256 over a canonical, typed JSON encoding of what goes into a compile.

Keys are built only from what the compiler consumes (the program without source locations, the compile
target, the options), never from what it produces, never from paths, pids, times or Python's ``hash``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

KEY_SCHEMA = 1


def canonical_json(components: Mapping[str, Any]) -> bytes:
    """A byte encoding that is identical across processes and hosts for equal components."""
    return json.dumps(components, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def cache_key(components: Mapping[str, Any]) -> str:
    """The key of an entry: the hex SHA-256 of its canonical components."""
    return digest(canonical_json({"schema": KEY_SCHEMA, **components}))


def executable_key_components(
    program: str, target: Mapping[str, Any], compile_options: bytes, version: str
) -> dict[str, Any]:
    """Components of a StableHLO → executable key. ``program`` is the module text without locations."""
    return {
        "kind": "executable",
        "program_sha256": digest(program),
        "target": dict(target),
        "compile_options_sha256": digest(compile_options),
        "tpucompile": version,
    }
