"""The StableHLO behind a cache key (``dump-hlo --key``) and a diff of two (``dump-hlo --diff``: why did it
recompile?), found in the cache or in a dump. Loads only jax's MLIR bindings, never torch."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import pathlib
from typing import Any

from tpucompile.cache import PersistentCache, differing_components
from tpucompile.cache.keys import is_key
from tpucompile.debug.layout import STAGES
from tpucompile.debug.reader import read_dump
from tpucompile.debug.stablehlo_text import module_text


@dataclasses.dataclass(frozen=True)
class StoredProgram:
    """The StableHLO stored under a key, and where it was found."""

    key: str
    text: str
    """Module text with inline source locations."""
    components: dict[str, Any] | None
    source: str


def stored_program(key: str, cache: PersistentCache | None, root: str | os.PathLike[str]) -> StoredProgram:
    """The StableHLO of a cache entry (a program entry, or the program an executable entry was compiled
    from) or of a dumped graph, by full key or unique prefix; ``LookupError`` saying why when there is none."""
    prefix = key.strip().lower()
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        raise LookupError(f"{key!r} is not a cache key (keys are hex digits)")
    if cache is not None:
        found = _from_cache(prefix, cache)
        if found is not None:
            return found
    dumped = [info for info in read_dump(root) if info["key"].startswith(prefix)]
    if len({info["key"] for info in dumped}) > 1:
        raise LookupError(f"{key} matches {len({i['key'] for i in dumped})} dumped graphs; give more of the key")
    if dumped:
        folder = pathlib.Path(root) / dumped[0]["folder"]
        components = json.loads((folder / "key.json").read_text())["components"]
        text = (folder / STAGES["stablehlo"]).read_text()
        return StoredProgram(dumped[0]["key"], text, components, f"dump {folder}")
    where = f"cache {cache.local.root}" if cache is not None else "no cache"
    raise LookupError(f"no cache entry or dumped graph has key {key} ({where}, dump {root})")


def _from_cache(prefix: str, cache: PersistentCache) -> StoredProgram | None:
    keys = [prefix] if is_key(prefix) else [k for k in cache.local.list_keys() if k.startswith(prefix)]
    if len(keys) > 1:
        raise LookupError(f"{prefix} matches {len(keys)} cache entries; give more of the key")
    found = cache.get(keys[0]) if keys else None
    if found is None:
        return None
    entry = found[0]
    if entry.kind == "program":
        return StoredProgram(entry.key, module_text(entry.payload), entry.components, f"cache {cache.local.root}")
    program_digest = entry.components.get("program")
    for row in cache.index.rows():
        if row["kind"] != "program":
            continue
        candidate = cache.get(row["key"])
        if candidate is not None and candidate[0].metadata.get("program_sha256") == program_digest:
            return StoredProgram(entry.key, module_text(candidate[0].payload), entry.components,
                                 f"cache {cache.local.root}")
    raise LookupError(f"cache entry {entry.key[:16]} is an executable whose StableHLO is not stored "
                      "(no program entry was made for it)")


def diff_programs(first: StoredProgram, second: StoredProgram) -> str:
    """A unified diff of two programs' StableHLO without locations (what their keys hash), or a line saying
    they are the same and which other key components differ."""
    a = module_text(first.text, locations=False).splitlines(keepends=True)
    b = module_text(second.text, locations=False).splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(a, b, fromfile=first.key[:16], tofile=second.key[:16]))
    if diff:
        return diff
    differing = differing_components(first.components or {}, second.components or {})
    reason = f"; the keys differ in: {', '.join(differing)}" if differing else ""
    return f"{first.key[:16]} and {second.key[:16]} have the same StableHLO{reason}\n"
