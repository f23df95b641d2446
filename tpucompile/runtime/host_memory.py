"""The host memory a process keeps after compiling large programs for other targets.

XLA's TPU compiler takes gigabytes of C heap while it compiles a large partitioned program and frees them when
it is done; glibc keeps most freed memory in its arenas (one per thread that allocated concurrently), so a
process that plans a large model holds gigabytes it no longer uses between compiles, and the next compile's
peak starts from there. ``release_free_memory`` hands the free pages back after each such compile (a library
call with no setting behind it); ``limit_heap_arenas`` caps glibc's arenas, a process-wide malloc setting
that only tpucompile's own commands take for themselves (a user's process sets ``MALLOC_ARENA_MAX``).
Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter number for the arena cap (``malloc.h``)."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None
    return libc


def release_free_memory() -> bool:
    """Return the C heap's free pages to the system; whether anything was returned (False off glibc)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def limit_heap_arenas(count: int = 2) -> bool:
    """Cap glibc's malloc arenas at ``count`` for this process (as ``MALLOC_ARENA_MAX`` would); whether the
    C library took the setting."""
    libc = _glibc()
    return bool(libc.mallopt(_M_ARENA_MAX, count)) if libc is not None else False
