"""Content-addressed compile cache. Knows keys and values, not torch."""

from tpucompile.cache.keys import cache_key, canonical_json, digest, executable_key_components
from tpucompile.cache.memory import CacheStats, MemoryStore, Store

__all__ = [
    "CacheStats",
    "MemoryStore",
    "Store",
    "cache_key",
    "canonical_json",
    "digest",
    "executable_key_components",
]
