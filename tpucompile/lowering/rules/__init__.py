"""Lowering rules, one module per op family. Importing this package registers them all."""

from tpucompile.lowering.rules import (  # noqa: F401
    conversions,
    creation,
    elementwise,
    indexing,
    matmul,
    normalization,
    random,
    reductions,
    unary,
    views,
)
