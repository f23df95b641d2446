"""The MLIR context lowering builds in: one per thread, reused, with every dialect we emit registered.

Building in a reused context is much cheaper than creating a fresh one per graph; MLIR contexts
are not thread-safe, so each thread gets its own.
"""

from __future__ import annotations

import threading

from jax.extend.mlir import ir
from jax.interpreters import mlir as jax_mlir

_local = threading.local()


def mlir_context() -> ir.Context:
    """This thread's MLIR context, with StableHLO, CHLO, func and Shardy dialects loaded."""
    ctx = getattr(_local, "context", None)
    if ctx is None:
        ctx = jax_mlir.make_ir_context()
        _local.context = ctx
    return ctx
