"""Content-addressed compile cache. Knows keys and bytes, not torch.

Tiers: ``MemoryStore`` (loaded values, in-process) → ``PersistentCache`` (a local directory, then an
optional remote store). Entries are ``Entry`` objects encoded without pickle (``entry.py``).
"""

from tpucompile.cache.entry import CorruptEntryError, Entry, decode, encode
from tpucompile.cache.keys import (
    ENVIRONMENT_COMPONENTS,
    cache_key,
    canonical_json,
    differing_components,
    digest,
    environment_mismatches,
    executable_key_components,
    program_key_components,
)
from tpucompile.cache.local import LocalStore, default_root
from tpucompile.cache.memory import CacheStats, MemoryStore
from tpucompile.cache.tiered import PersistentCache

__all__ = [
    "ENVIRONMENT_COMPONENTS",
    "CacheStats",
    "CorruptEntryError",
    "Entry",
    "LocalStore",
    "MemoryStore",
    "PersistentCache",
    "cache_key",
    "canonical_json",
    "decode",
    "default_root",
    "differing_components",
    "digest",
    "encode",
    "environment_mismatches",
    "executable_key_components",
    "program_key_components",
]
