"""Host memory after large compiles: free C heap pages go back to the system, and the arena cap is taken."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tpucompile.runtime import host_memory

glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="the C library is not glibc")


@glibc_only
def test_freed_heap_memory_goes_back_to_the_system():
    """Freed blocks between live ones stay with glibc (its heap cannot shrink past a live block) until
    ``release_free_memory`` returns their pages: the same state a large compile leaves."""
    script = textwrap.dedent("""
        import ctypes, resource
        from tpucompile.runtime.host_memory import release_free_memory

        def resident():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * resource.getpagesize()

        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        blocks = [libc.malloc(4096) for _ in range(100_000)]  # 400 MB in the heap, not mapped apart
        for block in blocks:
            ctypes.memset(block, 1, 4096)
        for index, block in enumerate(blocks):
            if index % 64:  # every 64th block stays live
                libc.free(block)
        held = resident()
        released = release_free_memory()
        print(held, resident(), released)
    """)
    held, after, released = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                           check=True).stdout.split()
    assert released == "True"
    assert int(held) - int(after) > 300 * 2**20, (held, after)  # most of the ~400 MB freed is returned


@glibc_only
def test_the_arena_cap_is_taken():
    """In a process of its own: the cap is a setting of the whole process."""
    script = "from tpucompile.runtime.host_memory import limit_heap_arenas; print(limit_heap_arenas(2))"
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout.split() == ["True"]
