"""Indexing, gather and scatter: ``x[idx]``, ``index_put``, ``torch.gather``/``scatter*`` and the ops built on them.

Everything lowers to ``stablehlo.gather`` / ``stablehlo.scatter`` (or a pad and a select) on static shapes.
Indices are wrapped (``i + size`` where ``i < 0``) because PyTorch accepts negative indices and XLA does not;
out-of-range indices stay undefined, as in XLA. Boolean mask indices give data-dependent shapes and are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_lowering

aten = torch.ops.aten
Value = ir.Value
Combiner = Callable[[Value, Value], Value]


# --- scatter update regions -----------------------------------------------------------------------------


def _replace(current: Value, update: Value) -> Value:
    return update


def _add(current: Value, update: Value) -> Value:
    if builder.dtype_of(current) is torch.bool:
        return hlo.or_(current, update)
    return hlo.add(current, update)


def _multiply(current: Value, update: Value) -> Value:
    if builder.dtype_of(current) is torch.bool:
        return hlo.and_(current, update)
    return hlo.multiply(current, update)


def _maximum(current: Value, update: Value) -> Value:
    if builder.dtype_of(current) is torch.bool:
        return hlo.or_(current, update)
    return hlo.maximum(current, update)  # propagates NaN, as torch's scatter amax does


def _minimum(current: Value, update: Value) -> Value:
    if builder.dtype_of(current) is torch.bool:
        return hlo.and_(current, update)
    return hlo.minimum(current, update)


# --- shared pieces ------------------------------------------------------------------------------------------


def _wrap_negative(index: Value, size: int) -> Value:
    """``index + size`` where ``index < 0``: PyTorch's negative indexing, which XLA does not have."""
    dtype, shape = builder.dtype_of(index), builder.shape_of(index)
    negative = builder.compare(index, builder.constant(0, dtype, shape), "LT")
    return builder.select(negative, hlo.add(index, builder.constant(size, dtype, shape)), index)


def _at_least_1d(value: Value) -> Value:
    """0-d operands of gather/scatter-style ops act as 1-element vectors; the caller reshapes back."""
    return builder.reshape(value, (1,)) if builder.rank_of(value) == 0 else value


@dataclasses.dataclass(frozen=True)
class _Advanced:
    """How a list of optional index tensors addresses an operand (PyTorch advanced indexing).

    The index tensors broadcast together to ``batch_shape``; the result is the operand's untouched dims with
    the batch dims inserted where the indexed dims were when those are adjacent, and in front otherwise.
    """

    positions: list[int]
    """Operand dims that have an index tensor."""
    starts: Value
    """The wrapped indices stacked on a trailing dim: ``batch_shape + [len(positions)]``."""
    batch_shape: tuple[int, ...]
    result_shape: tuple[int, ...]
    window_dims: list[int]
    """Result dims that are the operand's untouched dims (gather ``offset_dims``, scatter ``update_window_dims``)."""


def _advanced(x: Value, indices: Sequence[Value | None]) -> _Advanced | None:
    shape = builder.shape_of(x)
    entries = list(indices) + [None] * (len(shape) - len(indices))
    positions = [d for d, index in enumerate(entries) if index is not None]
    if not positions:
        return None
    tensors = [entries[d] for d in positions]
    dtypes = [builder.dtype_of(t) for t in tensors]
    if any(dtype in (torch.bool, torch.uint8) for dtype in dtypes):
        raise UnsupportedOpError(
            "boolean (or uint8) mask indices give a data-dependent shape, which tpucompile cannot compile; "
            "use torch.where or integer indices instead"
        )
    index_dtype = torch.int64 if torch.int64 in dtypes else torch.int32
    batch_shape = tuple(torch.broadcast_shapes(*(builder.shape_of(t) for t in tensors)))
    columns = []
    for d, tensor in zip(positions, tensors, strict=True):
        column = _wrap_negative(builder.convert(tensor, index_dtype), shape[d])
        columns.append(builder.reshape(builder.broadcast_to(column, batch_shape), (*batch_shape, 1)))
    starts = builder.concatenate(columns, len(batch_shape))
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    batch_at = positions[0] if adjacent else 0
    kept = [s for d, s in enumerate(shape) if d not in positions]
    result_shape = (*kept[:batch_at], *batch_shape, *kept[batch_at:])
    batch_dims = range(batch_at, batch_at + len(batch_shape))
    window_dims = [d for d in range(len(result_shape)) if d not in batch_dims]
    return _Advanced(positions, starts, batch_shape, result_shape, window_dims)


def _take(x: Value, indices: Sequence[Value | None]) -> Value:
    """``x[indices]`` for a list of optional integer index tensors (``aten.index.Tensor``)."""
    advanced = _advanced(x, indices)
    if advanced is None:
        return x
    positions = advanced.positions
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=advanced.window_dims,
        collapsed_slice_dims=positions,
        operand_batching_dims=[],
        start_indices_batching_dims=[],
        start_index_map=positions,
        index_vector_dim=len(advanced.batch_shape),
    )
    slice_sizes = [1 if d in positions else s for d, s in enumerate(builder.shape_of(x))]
    return hlo.gather(x, advanced.starts, numbers, slice_sizes)


def _put(x: Value, indices: Sequence[Value | None], values: Value, combiner: Combiner) -> Value:
    """``x[indices] = values`` (or ``combiner(x[indices], values)``) without mutating ``x``."""
    values = builder.convert(values, builder.dtype_of(x))
    advanced = _advanced(x, indices)
    if advanced is None:
        return combiner(x, builder.broadcast_to(values, builder.shape_of(x)))
    positions = advanced.positions
    numbers = hlo.ScatterDimensionNumbers.get(
        update_window_dims=advanced.window_dims,
        inserted_window_dims=positions,
        input_batching_dims=[],
        scatter_indices_batching_dims=[],
        scattered_dims_to_operand_dims=positions,
        index_vector_dim=len(advanced.batch_shape),
    )
    updates = builder.broadcast_to(values, advanced.result_shape)  # torch broadcasts values the same way
    return builder.scatter(x, advanced.starts, updates, numbers, combiner)


def _coordinates(index: Value, dim: int, size: int) -> Value:
    """Full start indices for ``torch.gather``-style ops: position ``p`` of ``index`` addresses the operand
    element ``p`` with ``p[dim]`` replaced by ``index[p]``. Shape: ``index.shape + [rank]``."""
    shape = builder.shape_of(index)
    columns = []
    for d in range(len(shape)):
        column = _wrap_negative(index, size) if d == dim else builder.iota(shape, builder.dtype_of(index), d)
        columns.append(builder.reshape(column, (*shape, 1)))
    return builder.concatenate(columns, len(shape))


def _pointwise_gather(x: Value, dim: int, index: Value) -> Value:
    """``torch.gather(x, dim, index)`` on operands of rank >= 1."""
    rank = builder.rank_of(x)
    starts = _coordinates(index, dim, builder.shape_of(x)[dim])
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[],
        collapsed_slice_dims=list(range(rank)),
        operand_batching_dims=[],
        start_indices_batching_dims=[],
        start_index_map=list(range(rank)),
        index_vector_dim=rank,
    )
    return hlo.gather(x, starts, numbers, [1] * rank)


def _pointwise_scatter(x: Value, dim: int, index: Value, src: Value, combiner: Combiner) -> Value:
    """``torch.scatter``-style update of ``x`` on operands of rank >= 1; only ``src[:index.shape]`` is used."""
    rank = builder.rank_of(x)
    index_shape = builder.shape_of(index)
    src = builder.convert(src, builder.dtype_of(x))
    if builder.shape_of(src) != index_shape:
        src = builder.slice_static(src, [0] * rank, index_shape, [1] * rank)
    starts = _coordinates(index, dim, builder.shape_of(x)[dim])
    numbers = hlo.ScatterDimensionNumbers.get(
        update_window_dims=[],
        inserted_window_dims=list(range(rank)),
        input_batching_dims=[],
        scatter_indices_batching_dims=[],
        scattered_dims_to_operand_dims=list(range(rank)),
        index_vector_dim=rank,
    )
    return builder.scatter(x, starts, src, numbers, combiner)


def _scalar_or_tensor(value: Value | bool | int | float, dtype: torch.dtype, shape: Sequence[int]) -> Value:
    if isinstance(value, ir.Value):
        return builder.broadcast_to(builder.convert(value, dtype), shape)
    return builder.constant(value, dtype, shape)


# --- advanced indexing --------------------------------------------------------------------------------------


@register_lowering(aten.index.Tensor, aten._unsafe_index.Tensor)
def _index(ctx, x, indices):
    return _take(x, indices)


@register_lowering(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put(ctx, x, indices, values, accumulate=False):
    return _put(x, indices, values, _add if accumulate else _replace)


@register_lowering(aten.index_select.default)
def _index_select(ctx, x, dim, index):
    x = _at_least_1d(x)
    dim %= builder.rank_of(x)
    index = builder.reshape(index, (ctx.aval_out.shape[dim] if ctx.aval_out.rank else 1,))
    return builder.reshape(_take(x, [None] * dim + [index]), ctx.aval_out.shape)


@register_lowering(aten.embedding.default)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return _take(weight, [indices])  # padding_idx and the flags only matter to the backward


def _index_update(ctx, x, dim, index, source, combiner: Combiner, fill: bool = False) -> Value:
    """``index_add`` / ``index_copy`` / ``index_fill``: update the slices ``index`` of ``x`` along ``dim``
    with the matching slices of ``source`` (or, with ``fill``, with the scalar ``source`` everywhere)."""
    x = _at_least_1d(x)
    shape = builder.shape_of(x)
    dim %= len(shape)
    count = _numel(builder.shape_of(index))
    index = builder.reshape(index, (count,))
    updates_shape = (*shape[:dim], count, *shape[dim + 1 :])
    if fill:
        source = _scalar_or_tensor(source, builder.dtype_of(x), updates_shape)
    else:
        source = builder.reshape(source, updates_shape)
    return builder.reshape(_put(x, [None] * dim + [index], source, combiner), ctx.aval_out.shape)


@register_lowering(aten.index_add.default)
def _index_add(ctx, x, dim, index, source, alpha=1):
    if alpha != 1:
        dtype = builder.dtype_of(source)
        source = hlo.multiply(source, builder.constant(alpha, dtype, builder.shape_of(source)))
    return _index_update(ctx, x, dim, index, source, _add)


@register_lowering(aten.index_copy.default)
def _index_copy(ctx, x, dim, index, source):
    return _index_update(ctx, x, dim, index, source, _replace)


@register_lowering(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def _index_fill(ctx, x, dim, index, value):
    return _index_update(ctx, x, dim, index, value, _replace, fill=True)


# --- torch.gather / torch.scatter ---------------------------------------------------------------------------


@register_lowering(aten.gather.default)
def _gather(ctx, x, dim, index, sparse_grad=False):
    x, index = _at_least_1d(x), _at_least_1d(index)
    dim %= builder.rank_of(x)
    return builder.reshape(_pointwise_gather(x, dim, index), ctx.aval_out.shape)


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for s in shape:
        count *= s
    return count


def _scatter_with(ctx, x, dim, index, src, combiner: Combiner) -> Value:
    x, index = _at_least_1d(x), _at_least_1d(index)
    dim %= builder.rank_of(x)
    if not isinstance(src, ir.Value):
        src = builder.constant(src, builder.dtype_of(x), builder.shape_of(index))
    src = _at_least_1d(src)
    return builder.reshape(_pointwise_scatter(x, dim, index, src, combiner), ctx.aval_out.shape)


@register_lowering(aten.scatter.src, aten.scatter.value)
def _scatter(ctx, x, dim, index, src):
    return _scatter_with(ctx, x, dim, index, src, _replace)


_LEGACY_REDUCTIONS: dict[str, Combiner] = {"add": _add, "multiply": _multiply}


@register_lowering(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_legacy_reduce(ctx, x, dim, index, src, reduce):
    return _scatter_with(ctx, x, dim, index, src, _LEGACY_REDUCTIONS[reduce])


@register_lowering(aten.scatter_add.default)
def _scatter_add(ctx, x, dim, index, src):
    return _scatter_with(ctx, x, dim, index, src, _add)


@register_lowering(aten.scatter_reduce.two)
def _scatter_reduce(ctx, x, dim, index, src, reduce, include_self=True):
    """``scatter_reduce``; with ``include_self=False`` the targeted elements start from the reduction's
    identity, and ``mean`` divides by how many values (self included or not) landed on each element."""
    dtype = builder.dtype_of(x)
    identities = {"sum": 0, "mean": 0, "prod": 1, "amax": builder.min_value(dtype), "amin": builder.max_value(dtype)}
    combiners = {"sum": _add, "mean": _add, "prod": _multiply, "amax": _maximum, "amin": _minimum}
    if reduce not in combiners:
        raise UnsupportedOpError(f"scatter_reduce with reduce={reduce!r} is not supported")
    x, index, src = _at_least_1d(x), _at_least_1d(index), _at_least_1d(src)
    dim %= builder.rank_of(x)
    shape, index_shape = builder.shape_of(x), builder.shape_of(index)
    base = x
    if not include_self:
        hit = _pointwise_scatter(
            builder.constant(False, torch.bool, shape), dim, index,
            builder.constant(True, torch.bool, index_shape), _replace,
        )
        base = builder.select(hit, builder.constant(identities[reduce], dtype, shape), x)
    out = _pointwise_scatter(base, dim, index, src, combiners[reduce])
    if reduce == "mean":
        count = _pointwise_scatter(
            builder.constant(1 if include_self else 0, dtype, shape), dim, index,
            builder.constant(1, dtype, index_shape), _add,
        )
        zero = builder.constant(0, dtype, shape)
        count = builder.select(builder.compare(count, zero, "EQ"), builder.constant(1, dtype, shape), count)
        out = _divide_by_positive(out, count)
    return builder.reshape(out, ctx.aval_out.shape)


def _divide_by_positive(a: Value, b: Value) -> Value:
    """``a / b`` for ``b > 0``; integers round toward -inf, as torch's scatter_reduce mean does."""
    quotient = hlo.divide(a, b)
    dtype = builder.dtype_of(a)
    if dtype.is_floating_point:
        return quotient
    shape = builder.shape_of(a)
    zero = builder.constant(0, dtype, shape)
    inexact = builder.compare(hlo.remainder(a, b), zero, "NE")
    negative = builder.compare(a, zero, "LT")
    lower = hlo.subtract(quotient, builder.constant(1, dtype, shape))
    return builder.select(hlo.and_(inexact, negative), lower, quotient)


# --- slice / select scatter, masked fill --------------------------------------------------------------------


def _strided_scatter(x: Value, src: Value, dim: int, start: int, step: int) -> Value:
    """Write ``src`` into ``x[..., start::step, ...]`` along ``dim``: pad it in place, then select."""
    shape = builder.shape_of(x)
    dtype = builder.dtype_of(x)
    count = builder.shape_of(src)[dim]
    if count == 0:
        return x
    rank = len(shape)
    low, high, interior = [0] * rank, [0] * rank, [0] * rank
    low[dim], interior[dim] = start, step - 1
    high[dim] = shape[dim] - start - (count - 1) * step - 1
    padded = hlo.pad(builder.convert(src, dtype), builder.constant(0, dtype), low, high, interior)
    mask = hlo.pad(
        builder.constant(True, torch.bool, (count,)),
        builder.constant(False, torch.bool),
        [low[dim]],
        [high[dim]],
        [interior[dim]],
    )
    return builder.select(builder.broadcast_in_dims(mask, shape, [dim]), padded, x)


@register_lowering(aten.slice_scatter.default)
def _slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    shape = builder.shape_of(x)
    dim %= len(shape)
    size = shape[dim]
    start = 0 if start is None else start
    start = min(max(start + size if start < 0 else start, 0), size)
    return _strided_scatter(x, src, dim, start, step)


@register_lowering(aten.select_scatter.default)
def _select_scatter(ctx, x, src, dim, index):
    shape = builder.shape_of(x)
    dim %= len(shape)
    index = index + shape[dim] if index < 0 else index
    src = builder.reshape(src, (*shape[:dim], 1, *shape[dim + 1 :]))
    return _strided_scatter(x, src, dim, index, 1)


@register_lowering(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(ctx, x, mask, value):
    shape, dtype = ctx.aval_out.shape, ctx.aval_out.dtype
    mask = builder.broadcast_to(builder.convert(mask, torch.bool), shape)
    fill = _scalar_or_tensor(value, dtype, shape)
    return builder.select(mask, fill, builder.broadcast_to(builder.convert(x, dtype), shape))
