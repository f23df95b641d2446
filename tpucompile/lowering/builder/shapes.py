"""Shapes and layout: sizes, PyTorch's per-dimension arguments, reshapes, transposes, NumPy-style
broadcasting, static slices and concatenation."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.builder.dtypes import dtype_of
from tpucompile.lowering.types import tensor_type


def shape_of(value: ir.Value) -> tuple[int, ...]:
    return tuple(ir.RankedTensorType(value.type).shape)


def rank_of(value: ir.Value) -> int:
    return ir.RankedTensorType(value.type).rank


def numel(shape: Iterable[int]) -> int:
    """The number of elements of a tensor of ``shape`` (1 for a 0-d tensor)."""
    return math.prod(shape)


def per_dim(values: Sequence[int] | int | None, count: int, default: Sequence[int] | None = None) -> list[int]:
    """ATen's per-spatial-dimension arguments as ``count`` ints: one int for every dim, a list of one or one
    per dim, or, when ``default`` is given, None or an empty list for ``default`` (pooling's stride)."""
    if default is not None and (values is None or (not isinstance(values, int) and len(values) == 0)):
        return list(default)
    if isinstance(values, int):
        return [values] * count
    values = list(values)
    return values * count if len(values) == 1 else values


def at_least_1d(value: ir.Value) -> ir.Value:
    """A 0-d value as a 1-element vector (ops that index, sort or count treat it so); others unchanged."""
    return reshape(value, (1,)) if rank_of(value) == 0 else value


def reshape(value: ir.Value, shape: Sequence[int]) -> ir.Value:
    shape = tuple(shape)
    if shape_of(value) == shape:
        return value
    return hlo.reshape(tensor_type(shape, dtype_of(value)), value)


def transpose(value: ir.Value, permutation: Sequence[int]) -> ir.Value:
    permutation = list(permutation)
    if permutation == list(range(len(permutation))):
        return value
    return hlo.transpose(value, permutation)


def broadcast_to(value: ir.Value, shape: Sequence[int]) -> ir.Value:
    """NumPy/PyTorch broadcasting: align trailing dimensions, stretch size-1 dimensions."""
    shape = tuple(shape)
    src = shape_of(value)
    if src == shape:
        return value
    offset = len(shape) - len(src)
    if offset < 0 or any(s not in (1, shape[offset + i]) for i, s in enumerate(src)):
        raise ValueError(f"cannot broadcast shape {src} to {shape}")
    return hlo.broadcast_in_dim(tensor_type(shape, dtype_of(value)), value, list(range(offset, len(shape))))


def broadcast_in_dims(value: ir.Value, shape: Sequence[int], dims: Iterable[int]) -> ir.Value:
    """Place ``value``'s dimensions at ``dims`` of a result of ``shape`` (explicit broadcast)."""
    return hlo.broadcast_in_dim(tensor_type(tuple(shape), dtype_of(value)), value, list(dims))


def slice_static(value: ir.Value, starts: Sequence[int], limits: Sequence[int], strides: Sequence[int]) -> ir.Value:
    return hlo.slice(value, list(starts), list(limits), list(strides))


def slice_along(value: ir.Value, dim: int, start: int, stop: int) -> ir.Value:
    """Elements ``start:stop`` of ``dim``, every other dim whole."""
    shape = shape_of(value)
    starts, limits = [0] * len(shape), list(shape)
    starts[dim], limits[dim] = start, stop
    return slice_static(value, starts, limits, [1] * len(shape))


def concatenate(values: Sequence[ir.Value], dimension: int) -> ir.Value:
    if len(values) == 1:
        return values[0]
    return hlo.concatenate(list(values), dimension)
