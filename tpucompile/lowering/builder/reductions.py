"""Reductions and scans whose combiner regions are built here: ``reduce``, ``reduce_window``, sums, maxima and
minima, and the inclusive scan."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.builder.constants import constant
from tpucompile.lowering.builder.dtypes import dtype_of, max_value, min_value
from tpucompile.lowering.builder.shapes import rank_of, shape_of
from tpucompile.lowering.types import tensor_type

Combiner = Callable[[Sequence[ir.Value], Sequence[ir.Value]], Sequence[ir.Value]]


def fill_combiner(op: ir.OpView, scalar_types: Sequence[ir.Type], combine: Combiner) -> None:
    """Build the combiner region of a reduce or reduce_window ``op``: its block takes one accumulator then one
    element per operand (``scalar_types``), and returns ``combine(accumulators, elements)``."""
    block = op.regions[0].blocks.append(*scalar_types, *scalar_types)
    count = len(scalar_types)
    with ir.InsertionPoint(block):
        args = list(block.arguments)
        hlo.return_(list(combine(args[:count], args[count:])))


def reduce(
    operands: Sequence[ir.Value],
    init_values: Sequence[ir.Value],
    dimensions: Sequence[int],
    body: Combiner,
) -> list[ir.Value]:
    """``stablehlo.reduce`` over ``dimensions``; ``body(accumulators, elements)`` builds the combiner."""
    dims = sorted(d % rank_of(operands[0]) for d in dimensions)
    in_shape = shape_of(operands[0])
    out_shape = [s for i, s in enumerate(in_shape) if i not in dims]
    result_types = [tensor_type(out_shape, dtype_of(v)) for v in operands]
    op = hlo.ReduceOp(result_types, list(operands), list(init_values), dims)
    fill_combiner(op, [tensor_type((), dtype_of(v)) for v in operands], body)
    return list(op.results)


def reduce_sum(x: ir.Value, dims: Sequence[int]) -> ir.Value:
    """The sum of ``x`` over ``dims`` in its own dtype; ``x`` itself when ``dims`` is empty."""
    if not dims:
        return x
    zero = constant(0, dtype_of(x), ())
    return reduce([x], [zero], dims, lambda acc, el: [hlo.add(acc[0], el[0])])[0]


def _extreme(x: ir.Value, dims: Sequence[int], is_max: bool) -> ir.Value:
    if not dims:
        return x
    dtype = dtype_of(x)
    if dtype is torch.bool:
        init = constant(not is_max, torch.bool, ())
        combine = hlo.or_ if is_max else hlo.and_
    else:
        init = constant(min_value(dtype) if is_max else max_value(dtype), dtype, ())
        combine = hlo.maximum if is_max else hlo.minimum
    return reduce([x], [init], dims, lambda acc, el: [combine(acc[0], el[0])])[0]


def reduce_max(x: ir.Value, dims: Sequence[int]) -> ir.Value:
    """The max of ``x`` over ``dims`` (``or`` of bools; NaN propagates, as in torch); ``x`` when ``dims`` is empty."""
    return _extreme(x, dims, True)


def reduce_min(x: ir.Value, dims: Sequence[int]) -> ir.Value:
    """The min of ``x`` over ``dims`` (``and`` of bools; NaN propagates, as in torch); ``x`` when ``dims`` is empty."""
    return _extreme(x, dims, False)


def reduce_window(
    operand: ir.Value,
    init_value: ir.Value,
    window: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    body: Callable[[ir.Value, ir.Value], ir.Value],
    base_dilations: Sequence[int] | None = None,
    window_dilations: Sequence[int] | None = None,
) -> ir.Value:
    """``stablehlo.reduce_window`` with a binary combiner; shapes follow the StableHLO formula."""
    in_shape = shape_of(operand)
    base_dilations = list(base_dilations or [1] * len(in_shape))
    window_dilations = list(window_dilations or [1] * len(in_shape))
    out_shape = []
    for size, w, s, (lo, hi), bd, wd in zip(
        in_shape, window, strides, padding, base_dilations, window_dilations, strict=True
    ):
        dilated = (size - 1) * bd + 1 + lo + hi
        dilated_window = (w - 1) * wd + 1
        out_shape.append(max(0, (dilated - dilated_window) // s + 1))
    dtype = dtype_of(operand)
    op = hlo.ReduceWindowOp(
        [tensor_type(out_shape, dtype)],
        [operand],
        [init_value],
        list(window),
        window_strides=list(strides),
        base_dilations=base_dilations,
        window_dilations=window_dilations,
        padding=ir.DenseIntElementsAttr.get(
            np.asarray(padding, dtype=np.int64).reshape(len(in_shape), 2)
        ),
    )
    scalar = tensor_type((), dtype)
    block = op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        hlo.return_([body(*block.arguments)])
    return op.result


def scan(operands: Sequence[ir.Value], identities: Sequence[ir.Value], dim: int, combine: Combiner) -> list[ir.Value]:
    """Inclusive scan of same-shaped ``operands`` along ``dim``: result ``k`` combines elements ``0..k``.

    A ``reduce_window`` whose window spans the whole dim, with ``size - 1`` elements of low padding (filled
    with the identities), which XLA turns into a log-depth scan. ``identities`` are 0-d values that
    ``combine`` leaves unchanged; ``combine(acc, el)`` returns one value per operand and, as the window's
    reduction order is unspecified, must be associative and commutative.
    """
    shape = shape_of(operands[0])
    rank = len(shape)
    window = [1] * rank
    window[dim] = shape[dim]
    padding = np.zeros((rank, 2), dtype=np.int64)
    padding[dim, 0] = shape[dim] - 1
    op = hlo.ReduceWindowOp(
        [v.type for v in operands],
        list(operands),
        list(identities),
        window,
        window_strides=[1] * rank,
        base_dilations=[1] * rank,
        window_dilations=[1] * rank,
        padding=ir.DenseIntElementsAttr.get(padding),
    )
    fill_combiner(op, [tensor_type((), dtype_of(v)) for v in operands], combine)
    return list(op.results)
