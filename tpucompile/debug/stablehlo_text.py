"""StableHLO modules as text: the recorder prints the module it was given, the program lookup re-reads stored
text or bytecode; both print it the same way, with each op's source location inline or with none."""

from __future__ import annotations

import functools
from typing import Any


def asm(module: Any, locations: bool) -> str:
    """Module text; with ``locations`` each op's location is written inline, so a line is greppable."""
    return module.operation.get_asm(enable_debug_info=locations, use_local_scope=locations)


def module_text(module: bytes | str, locations: bool = True) -> str:
    """Parse StableHLO (text or MLIR bytecode) and print it, with inline locations or without any."""
    from jax.extend.mlir import ir

    with _mlir_context():
        return asm(ir.Module.parse(module), locations)


@functools.cache
def _mlir_context() -> Any:
    from jax.interpreters import mlir as jax_mlir

    return jax_mlir.make_ir_context()
