"""Gathers and scatters: ``torch.gather``-style reads along one dim, PyTorch's negative indices, and scatters
whose update region is built here."""

from __future__ import annotations

from collections.abc import Callable

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.builder.constants import constant, iota
from tpucompile.lowering.builder.dtypes import dtype_of
from tpucompile.lowering.builder.elementwise import compare, select
from tpucompile.lowering.builder.shapes import broadcast_to, concatenate, rank_of, reshape, shape_of
from tpucompile.lowering.types import tensor_type


def scatter(
    operand: ir.Value,
    indices: ir.Value,
    updates: ir.Value,
    dimension_numbers: ir.Attribute,
    combiner: Callable[[ir.Value, ir.Value], ir.Value],
    unique_indices: bool = False,
) -> ir.Value:
    """``stablehlo.scatter`` of one operand; ``combiner(current, update)`` builds the update region.

    The result has the operand's type.
    """
    dtype = dtype_of(operand)
    op = hlo.ScatterOp(
        [operand.type], [operand], indices, [updates], dimension_numbers, unique_indices=unique_indices
    )
    scalar = tensor_type((), dtype)
    block = op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        hlo.return_([combiner(*block.arguments)])
    return op.results[0]


def scatter_rows(
    target: ir.Value, rows: ir.Value, updates: ir.Value, combiner: Callable[[ir.Value, ir.Value], ir.Value]
) -> ir.Value:
    """Combine ``updates[i]`` into ``target[rows[i]]`` along dim 0; ``rows`` is ``(n, 1)`` and rows out of
    range are dropped."""
    rank = rank_of(target)
    numbers = hlo.ScatterDimensionNumbers.get(
        update_window_dims=list(range(1, rank)),
        inserted_window_dims=[0],
        input_batching_dims=[],
        scatter_indices_batching_dims=[],
        scattered_dims_to_operand_dims=[0],
        index_vector_dim=1,
    )
    return scatter(target, rows, updates, numbers, combiner)


def wrap_negative(index: ir.Value, size: int | ir.Value) -> ir.Value:
    """``index + size`` where ``index < 0``: PyTorch's negative indexing, which XLA does not have. ``size`` is a
    number, or a scalar of ``index``'s dtype known when the program runs (a dimension padded to a bucket, whose
    negative indices count from its actual end)."""
    dtype, shape = dtype_of(index), shape_of(index)
    negative = compare(index, constant(0, dtype, shape), "LT")
    size = constant(size, dtype, shape) if isinstance(size, int) else broadcast_to(size, shape)
    return select(negative, hlo.add(index, size), index)


def index_coordinates(index: ir.Value, dim: int, size: int) -> ir.Value:
    """Full start indices for ``torch.gather``/``scatter``-style ops: position ``p`` of ``index`` addresses
    the operand element ``p`` with ``p[dim]`` replaced by ``index[p]`` (wrapped into ``size``). Shape:
    ``index.shape + [rank]``."""
    shape = shape_of(index)
    columns = []
    for d in range(len(shape)):
        column = wrap_negative(index, size) if d == dim else iota(shape, dtype_of(index), d)
        columns.append(reshape(column, (*shape, 1)))
    return concatenate(columns, len(shape))


def take_along(x: ir.Value, dim: int, index: ir.Value) -> ir.Value:
    """``torch.gather(x, dim, index)`` (int32/int64 ``index``, negative entries wrap) for rank >= 1 operands."""
    rank = rank_of(x)
    starts = index_coordinates(index, dim, shape_of(x)[dim])
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[],
        collapsed_slice_dims=list(range(rank)),
        operand_batching_dims=[],
        start_indices_batching_dims=[],
        start_index_map=list(range(rank)),
        index_vector_dim=rank,
    )
    return hlo.gather(x, starts, numbers, [1] * rank)
