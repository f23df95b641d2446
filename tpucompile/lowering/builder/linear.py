"""Linear maps: ``dot_general``, a separable map of the trailing dims by constant matrices, and the
identity matrix."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.builder.constants import dense_constant, iota
from tpucompile.lowering.builder.dtypes import convert, dtype_of
from tpucompile.lowering.builder.elementwise import compare
from tpucompile.lowering.builder.shapes import rank_of, shape_of
from tpucompile.lowering.types import tensor_type


def dot_general(
    lhs: ir.Value,
    rhs: ir.Value,
    contracting: tuple[Sequence[int], Sequence[int]],
    batch: tuple[Sequence[int], Sequence[int]] = ((), ()),
    out_dtype: torch.dtype | None = None,
) -> ir.Value:
    """``stablehlo.dot_general``; the result holds batch dims, then lhs free dims, then rhs free dims."""
    lhs_shape, rhs_shape = shape_of(lhs), shape_of(rhs)
    (lc, rc), (lb, rb) = contracting, batch
    free_l = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    free_r = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
    out_shape = [lhs_shape[d] for d in lb] + [lhs_shape[d] for d in free_l] + [rhs_shape[d] for d in free_r]
    dims = hlo.DotDimensionNumbers.get(
        lhs_batching_dimensions=list(lb),
        rhs_batching_dimensions=list(rb),
        lhs_contracting_dimensions=list(lc),
        rhs_contracting_dimensions=list(rc),
    )
    dtype = out_dtype or dtype_of(lhs)
    return hlo.dot_general(tensor_type(out_shape, dtype), lhs, rhs, dims)


def contract_trailing(x: ir.Value, matrices: Sequence[np.ndarray]) -> ir.Value:
    """Apply one matrix ``(new, old)`` to each of the trailing ``len(matrices)`` dims of ``x`` (in ``x``'s
    dtype, at highest precision): a separable linear map such as adaptive averaging or resampling."""
    nd = len(matrices)
    dtype = dtype_of(x)
    precision = ir.ArrayAttr.get([hlo.PrecisionAttr.get("HIGHEST")] * 2)
    first = rank_of(x) - nd
    for matrix in matrices:
        m = dense_constant(torch.from_numpy(np.ascontiguousarray(matrix)).to(dtype))
        # Contract the first mapped dim; its replacement goes last, so after nd steps the order is restored.
        shape = shape_of(x)
        out_shape = [*shape[:first], *shape[first + 1 :], matrix.shape[0]]
        numbers = hlo.DotDimensionNumbers.get(
            lhs_batching_dimensions=[],
            rhs_batching_dimensions=[],
            lhs_contracting_dimensions=[first],
            rhs_contracting_dimensions=[1],
        )
        x = hlo.dot_general(tensor_type(out_shape, dtype), x, m, numbers, precision_config=precision)
    return x


def eye(shape: Sequence[int], dtype: torch.dtype) -> ir.Value:
    """Ones where row == column in the last two dims of ``shape`` (any rectangle), zeros elsewhere."""
    rank = len(shape)
    diagonal = compare(iota(shape, torch.int64, rank - 2), iota(shape, torch.int64, rank - 1), "EQ")
    return convert(diagonal, dtype)
