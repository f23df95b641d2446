"""The runtime libraries a compiled program calls into, and making them ready before a cached program runs.

A compiled XLA program may call custom-call targets: jaxlib's LAPACK kernels (``lapack_sgetrf_ffi``, ...),
this runtime's host kernels (``host_kernels``), anything registered through ``jax.ffi``. Some need set-up in
the process that runs them, not only a registration: jaxlib's LAPACK handlers are registered when jax
imports, but they find the LAPACK routines they call only once ``_lapack.initialize()`` has run, which jax
does while *lowering* a linear-algebra op. A cold compile lowers, a warm start from the cache does not, and
an uninitialised handler jumps through a null pointer (SIGSEGV inside XLA's execute).

So each compiled program's entry records the targets its optimised HLO calls (``targets_of``), and a
process prepares them before it loads the program (``prepare``): known libraries are initialised, and a
target this process cannot serve makes the entry a miss with a reason instead of a crash. A program compiled
now needs the same (``make_ready``): its StableHLO may come from the cache, lowered by another process.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

from jaxlib import xla_client

_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')

_PROCESS_BOUND = ("xla_python_cpu_callback", "xla_python_gpu_callback", "xla_buffer_python_cpu_callback",
                  "xla_ffi_python_cpu_callback", "xla_ffi_python_gpu_callback",
                  "xla_ffi_partitioned_python_cpu_callback", "xla_ffi_partitioned_python_gpu_callback")
"""Targets whose calls carry the address of a Python object of the compiling process: no other process can
run such a program."""


def targets_of(executable: object, platform: str) -> list[str]:
    """The sorted custom-call targets registered with this process's XLA that ``executable``'s optimised HLO
    calls when it runs. Calls that XLA's backends emit and run themselves (oneDNN, cuBLAS) are in no
    registry and need nothing from the process, so they are left out."""
    found: set[str] = set()
    for module in executable.hlo_modules():
        found.update(_CUSTOM_CALL_TARGET.findall(module.to_string()))
    registered = _registered_targets(platform)
    return sorted(name for name in found if name in registered)


def prepare(targets: Iterable[str], platform: str) -> str | None:
    """Make every target in ``targets`` (``targets_of`` a cached program) ready to run in this process on
    ``platform``; None when they all are, else why one cannot be (the caller treats the program as absent)."""
    targets = list(targets)
    registered = _registered_targets(platform) if targets else {}
    for name in targets:
        if name in _PROCESS_BOUND:
            return f"it calls {name}, which holds a Python object of the process that compiled it"
        if name not in registered:
            return f"it calls custom-call target {name!r}, which is not registered in this process"
        for prefix, initialise in _INITIALISERS:
            if name.startswith(prefix):
                initialise()
    return None


def make_ready(executable: object, platform: str) -> None:
    """Set up the libraries a program just compiled in this process calls, before it first runs (its
    StableHLO may have been lowered by another process, so nothing here has initialised them)."""
    unready = prepare(targets_of(executable, platform), platform)
    if unready is not None:
        raise RuntimeError(f"the compiled program cannot run in this process: {unready}")


def _registered_targets(platform: str) -> dict:
    """The custom-call targets registered with XLA for ``platform`` in this process (both names that jaxlib
    files CPU registrations under)."""
    names = {"cpu": ("cpu", "Host")}.get(platform.lower(), (platform, platform.upper(), platform.lower()))
    registered: dict = {}
    for name in names:
        registered.update(xla_client._xla.custom_call_targets(name))
    return registered


@functools.cache
def _initialise_lapack() -> None:
    """Point jaxlib's LAPACK handlers at the LAPACK routines they call (what jax does when it lowers a
    linear-algebra op); idempotent."""
    from jaxlib import lapack

    lapack._lapack.initialize()


_INITIALISERS: tuple[tuple[str, Callable[[], None]], ...] = (("lapack_", _initialise_lapack),)
"""Target-name prefixes whose library needs set-up in the running process, and the set-up."""
