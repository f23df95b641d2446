"""Lowering rules, one module per op family. Importing this package registers them all."""

from tpucompile.lowering.rules import (  # noqa: F401
    conversions,
    convolution,
    creation,
    elementwise,
    embedding_bag,
    indexing,
    linalg,
    matmul,
    normalization,
    pooling,
    random,
    reductions,
    resampling,
    scans,
    sorting,
    unary,
    views,
)
