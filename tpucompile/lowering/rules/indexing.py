"""Indexing, gather and scatter: ``x[idx]``, ``index_put``, ``torch.gather``/``scatter*`` and the ops built on them.

Everything lowers to ``stablehlo.gather`` / ``stablehlo.scatter`` (or a pad and a select) on static shapes.
Indices are wrapped (``i + size`` where ``i < 0``) because PyTorch accepts negative indices and XLA does not;
out-of-range indices stay undefined, as in XLA. A boolean mask index usually gives a data-dependent shape and is
refused; two uses keep static shapes and are lowered with a prefix sum of the mask (each True position's rank
among the True ones): ``x[mask] = v`` (``index_put``) and ``x[mask]`` where the graph already knows the count
(the backward of such an ``index_put``). ``masked_scatter`` and ``nonzero_static`` work the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder, dynamic_sizes, jax_bridge
from tpucompile.lowering.registry import register_rule

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


def _advanced(x: Value, indices: Sequence[Value | None], extents: Sequence[Value | None] = (),
              dropped: Sequence[Sequence[Value | None] | None] = ()) -> _Advanced | None:
    """``extents``: per operand dim, its actual size where a bucket pads it (negative indices count from the
    actual end, as they do in the unpadded tensor), else None. ``dropped``: per index tensor, the actual size
    of each of its own dims that a bucket pads; the indices in that padding are sent out of range, where a
    scatter drops its update (the padding holds any index, which would write over an actual element)."""
    shape = builder.shape_of(x)
    extents = list(extents) + [None] * (len(shape) - len(extents))
    dropped = list(dropped) + [None] * (len(shape) - len(dropped))
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
        column = builder.convert(tensor, index_dtype)
        extent = extents[d]
        column = builder.wrap_negative(column, shape[d] if extent is None else builder.convert(extent, index_dtype))
        for k, actual in enumerate(dropped[d] or ()):
            if actual is not None:
                inside = dynamic_sizes.within_actual(builder.shape_of(column), k, actual)
                out_of_range = builder.constant(shape[d], index_dtype, builder.shape_of(column))
                column = builder.select(inside, column, out_of_range)
        columns.append(builder.reshape(builder.broadcast_to(column, batch_shape), (*batch_shape, 1)))
    starts = builder.concatenate(columns, len(batch_shape))
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    batch_at = positions[0] if adjacent else 0
    kept = [s for d, s in enumerate(shape) if d not in positions]
    result_shape = (*kept[:batch_at], *batch_shape, *kept[batch_at:])
    batch_dims = range(batch_at, batch_at + len(batch_shape))
    window_dims = [d for d in range(len(result_shape)) if d not in batch_dims]
    return _Advanced(positions, starts, batch_shape, result_shape, window_dims)


def _take(x: Value, indices: Sequence[Value | None], extents: Sequence[Value | None] = ()) -> Value:
    """``x[indices]`` for a list of optional integer index tensors (``aten.index.Tensor``)."""
    advanced = _advanced(x, indices, extents)
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


def _put(x: Value, indices: Sequence[Value | None], values: Value, combiner: Combiner,
         extents: Sequence[Value | None] = (), dropped: Sequence[Sequence[Value | None] | None] = ()) -> Value:
    """``x[indices] = values`` (or ``combiner(x[indices], values)``) without mutating ``x``."""
    values = builder.convert(values, builder.dtype_of(x))
    advanced = _advanced(x, indices, extents, dropped)
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


def _pointwise_scatter(x: Value, dim: int, index: Value, src: Value, combiner: Combiner) -> Value:
    """``torch.scatter``-style update of ``x`` on operands of rank >= 1; only ``src[:index.shape]`` is used."""
    rank = builder.rank_of(x)
    index_shape = builder.shape_of(index)
    src = builder.convert(src, builder.dtype_of(x))
    if builder.shape_of(src) != index_shape:
        src = builder.slice_static(src, [0] * rank, index_shape, [1] * rank)
    starts = builder.index_coordinates(index, dim, builder.shape_of(x)[dim])
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


@register_rule(aten.index.Tensor, aten._unsafe_index.Tensor)
def _index(ctx, x, indices):
    if 0 in ctx.aval_out.shape:  # nothing to gather (and XLA refuses gathers from an empty dimension)
        return builder.constant(0, ctx.aval_out.dtype, ctx.aval_out.shape)
    masked = _single_mask(indices)
    if masked is not None:
        return _masked_take(x, masked[0], masked[1], ctx.aval_out.shape)
    meta = ctx.operand_metas[0]
    return _take(x, indices, [ctx.extent(meta, d) for d in range(meta.dim())])


def _masked_take(x: Value, position: int, mask: Value, out_shape: Sequence[int]) -> Value:
    """``x[..., mask, ...]`` when the graph knows how many elements the mask selects (the backward of a masked
    ``index_put`` does): row i of the result is the i-th True position, found by scattering each True
    position to its rank among the True ones."""
    shape = builder.shape_of(x)
    mask = builder.convert(mask, torch.bool)
    mask_shape = builder.shape_of(mask)
    k = len(mask_shape)
    size = builder.numel(mask_shape)
    count = out_shape[position]
    flat_mask = builder.reshape(mask, (size,))
    slot = builder.select(flat_mask, _rank_among_true(flat_mask), builder.constant(count, torch.int64, (size,)))
    where = _put(builder.constant(0, torch.int64, (count + 1,)), [slot], builder.iota((size,), torch.int64, 0),
                 _replace)
    where = builder.slice_static(where, [0], [count], [1])
    flat = builder.reshape(x, (*shape[:position], size, *shape[position + k :]))
    return builder.reshape(_take(flat, [None] * position + [where]), out_shape)


@register_rule(aten.index_put.default, aten._unsafe_index_put.default)
def _index_put(ctx, x, indices, values, accumulate=False):
    combiner = _add if accumulate else _replace
    masked = _single_mask(indices)
    if masked is not None:
        return _masked_put(x, masked[0], masked[1], values, combiner)
    meta = ctx.operand_metas[0]
    extents = [ctx.extent(meta, d) for d in range(meta.dim())]
    dropped = [None if m is None else [ctx.extent(m, k) for k in range(m.dim())] for m in ctx.operand_metas[1]]
    # XLA's scatter takes a runtime-sized update window only where the operand's is the same: both are made
    # fixed-shape (the padding of an update lands in the operand's padding, or its index is dropped)
    x = dynamic_sizes.fixed_where_padded(x, meta, ctx.extent, ctx.fixed_in_place)
    if isinstance(values, ir.Value):
        values = dynamic_sizes.fixed_where_padded(values, ctx.operand_metas[2], ctx.extent, ctx.fixed_in_place)
    return _put(x, indices, values, combiner, extents, dropped)


def _single_mask(indices: Sequence[Value | None]) -> tuple[int, Value] | None:
    """``(position, mask)`` when the only index tensor is a boolean (or uint8) mask, else None."""
    present = [(d, index) for d, index in enumerate(indices) if index is not None]
    if len(present) != 1 or builder.dtype_of(present[0][1]) not in (torch.bool, torch.uint8):
        return None
    return present[0]


def _masked_put(x: Value, position: int, mask: Value, values: Value, combiner: Combiner) -> Value:
    """``x[..., mask, ...] = values`` with a static result: ``x[mask]`` lists the masked positions in
    row-major order, so the i-th True position takes row i of ``values`` (row = a prefix sum of the mask)
    when ``values`` has one row per True position, or the one broadcast row otherwise."""
    shape, dtype = builder.shape_of(x), builder.dtype_of(x)
    mask = builder.convert(mask, torch.bool)
    mask_shape = builder.shape_of(mask)
    k = len(mask_shape)
    before, after = shape[:position], shape[position + k :]
    values = builder.convert(values, dtype)
    rank = len(before) + 1 + len(after)
    values = builder.reshape(values, (1,) * (rank - builder.rank_of(values)) + builder.shape_of(values))
    value_shape = builder.shape_of(values)
    rows = value_shape[position]
    if rows == 1:
        values = builder.reshape(values, value_shape[:position] + value_shape[position + 1 :])
        kept = [*range(position), *range(position + k, len(shape))]
        full = builder.broadcast_in_dims(values, shape, kept) if kept else builder.broadcast_to(values, shape)
    else:
        flat_mask = builder.reshape(mask, (builder.numel(mask_shape),))
        source = _clamped_rank(flat_mask, rows)
        values = builder.broadcast_to(values, (*before, rows, *after))
        taken = _take(values, [None] * position + [source])
        full = builder.reshape(taken, shape)
    mask = builder.broadcast_in_dims(mask, shape, list(range(position, position + k)))
    return builder.select(mask, combiner(x, full), x)


def _rank_among_true(mask: Value) -> Value:
    """For a 1-d bool ``mask``: how many True entries come before each position (int64)."""
    ones = builder.convert(mask, torch.int64)
    zero = builder.constant(0, torch.int64)
    (inclusive,) = builder.scan([ones], [zero], 0, lambda acc, el: [hlo.add(acc[0], el[0])])
    return hlo.subtract(inclusive, ones)


def _clamped_rank(mask: Value, count: int) -> Value:
    """``_rank_among_true`` clamped into ``[0, count)``, for gathers whose False lanes are discarded."""
    rank = _rank_among_true(mask)
    shape = builder.shape_of(rank)
    low, high = builder.constant(0, torch.int64, shape), builder.constant(max(count - 1, 0), torch.int64, shape)
    return hlo.clamp(low, rank, high)


@register_rule(aten.index_select.default)
def _index_select(ctx, x, dim, index):
    x = builder.at_least_1d(x)
    dim %= builder.rank_of(x)
    index = builder.reshape(index, (ctx.aval_out.shape[dim] if ctx.aval_out.rank else 1,))
    return builder.reshape(_take(x, [None] * dim + [index]), ctx.aval_out.shape)


@register_rule(aten.take.default)
def _take_flat(ctx, x, index):
    """``torch.take``: ``x`` read as if flattened (PyTorch's decomposition turns a 0-d index into ``.item()``)."""
    if 0 in ctx.aval_out.shape:
        return builder.constant(0, ctx.aval_out.dtype, ctx.aval_out.shape)
    flat = builder.reshape(x, (builder.numel(builder.shape_of(x)),))
    positions = builder.reshape(index, (builder.numel(builder.shape_of(index)),))
    return builder.reshape(_take(flat, [positions]), ctx.aval_out.shape)


@register_rule(aten.embedding.default)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return _take(weight, [indices])  # padding_idx and the flags only matter to the backward


@register_rule(aten.embedding_renorm.default)
def _embedding_renorm(ctx, weight, indices, max_norm, norm_type):
    """``embedding(max_norm=)``'s rescale: rows that ``indices`` reads and whose ``norm_type``-norm exceeds
    ``max_norm`` are scaled by ``max_norm / (norm + 1e-7)``, as the eager kernel does row by row."""

    def fn(weight, indices):
        import jax.numpy as jnp

        rows = weight.astype(jnp.float32)
        norms = jnp.linalg.norm(rows, ord=norm_type, axis=1)
        read = jnp.zeros((weight.shape[0],), bool).at[indices.reshape(-1)].set(True, mode="drop")
        scale = jnp.where(read & (norms > max_norm), max_norm / (norms + 1e-7), 1.0)
        return (rows * scale[:, None]).astype(weight.dtype)

    return jax_bridge.call("embedding_renorm", fn, [weight, indices], [ctx.aval_out],
                           params=(float(max_norm), float(norm_type)))[0]


def _slices_along(x: Value, dim: int, index: Value) -> tuple[Value, int, Value, tuple[int, ...]]:
    """For updates of whole slices of ``x`` along ``dim``: ``x`` (at least 1-d), ``dim`` made positive, the
    flattened ``index``, and the shape the updates have (``x``'s, with ``dim`` sized by the index)."""
    x = builder.at_least_1d(x)
    shape = builder.shape_of(x)
    dim %= len(shape)
    count = builder.numel(builder.shape_of(index))
    index = builder.reshape(index, (count,))
    return x, dim, index, (*shape[:dim], count, *shape[dim + 1 :])


def _index_update(ctx, x, dim, index, source, combiner: Combiner, fill: bool = False) -> Value:
    """``index_add`` / ``index_copy`` / ``index_fill``: update the slices ``index`` of ``x`` along ``dim``
    with the matching slices of ``source`` (or, with ``fill``, with the scalar ``source`` everywhere)."""
    x, dim, index, updates_shape = _slices_along(x, dim, index)
    if fill:
        source = _scalar_or_tensor(source, builder.dtype_of(x), updates_shape)
    else:
        source = builder.reshape(source, updates_shape)
    return builder.reshape(_put(x, [None] * dim + [index], source, combiner), ctx.aval_out.shape)


@register_rule(aten.index_add.default)
def _index_add(ctx, x, dim, index, source, alpha=1):
    return _index_update(ctx, x, dim, index, builder.scaled(source, alpha), _add)


@register_rule(aten.index_copy.default)
def _index_copy(ctx, x, dim, index, source):
    return _index_update(ctx, x, dim, index, source, _replace)


@register_rule(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def _index_fill(ctx, x, dim, index, value):
    return _index_update(ctx, x, dim, index, value, _replace, fill=True)


# --- torch.gather / torch.scatter ---------------------------------------------------------------------------


@register_rule(aten.gather.default)
def _gather(ctx, x, dim, index, sparse_grad=False):
    if builder.numel(ctx.aval_out.shape) == 0:  # an empty index may have any rank (torch only checks non-empty ones)
        return builder.constant(0, ctx.aval_out.dtype, ctx.aval_out.shape)
    x, index = builder.at_least_1d(x), builder.at_least_1d(index)
    dim %= builder.rank_of(x)
    return builder.reshape(builder.take_along(x, dim, index), ctx.aval_out.shape)


def _drop_padded_indices(ctx, index: Value, size: int) -> Value:
    """In a bucketed program, ``index`` with its elements past the actual sizes of its runtime-sized
    dimensions set to ``size`` (out of range), so that XLA's scatter drops their updates: the padding holds
    any index, which would write over actual elements."""
    meta = ctx.operand_metas[2]
    shape = builder.shape_of(index)
    for d in range(len(shape)):
        extent = ctx.extent(meta, d) if meta.dim() else None
        if extent is not None:
            inside = dynamic_sizes.within_actual(shape, d, extent)
            index = builder.select(inside, index, builder.constant(size, builder.dtype_of(index), shape))
    return index


def _scatter_with(ctx, x, dim, index, src, combiner: Combiner) -> Value:
    x, index = builder.at_least_1d(x), builder.at_least_1d(index)
    dim %= builder.rank_of(x)
    index = _drop_padded_indices(ctx, index, builder.shape_of(x)[dim])
    if not isinstance(src, ir.Value):
        src = builder.constant(src, builder.dtype_of(x), builder.shape_of(index))
    src = builder.at_least_1d(src)
    return builder.reshape(_pointwise_scatter(x, dim, index, src, combiner), ctx.aval_out.shape)


@register_rule(aten.scatter.src, aten.scatter.value)
def _scatter(ctx, x, dim, index, src):
    return _scatter_with(ctx, x, dim, index, src, _replace)


_LEGACY_REDUCTIONS: dict[str, Combiner] = {"add": _add, "multiply": _multiply}


@register_rule(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_legacy_reduce(ctx, x, dim, index, src, reduce):
    return _scatter_with(ctx, x, dim, index, src, _LEGACY_REDUCTIONS[reduce])


@register_rule(aten.scatter_add.default)
def _scatter_add(ctx, x, dim, index, src):
    return _scatter_with(ctx, x, dim, index, src, _add)


@register_rule(aten.scatter_reduce.two)
def _scatter_reduce(ctx, x, dim, index, src, reduce, include_self=True):
    """``scatter_reduce``; with ``include_self=False`` the targeted elements start from the reduction's
    identity, and ``mean`` divides by how many values (self included or not) landed on each element."""
    dtype = builder.dtype_of(x)
    identities = {"sum": 0, "mean": 0, "prod": 1, "amax": builder.min_value(dtype), "amin": builder.max_value(dtype)}
    combiners = {"sum": _add, "mean": _add, "prod": _multiply, "amax": _maximum, "amin": _minimum}
    if reduce not in combiners:
        raise UnsupportedOpError(f"scatter_reduce with reduce={reduce!r} is not supported")
    x, index, src = builder.at_least_1d(x), builder.at_least_1d(index), builder.at_least_1d(src)
    dim %= builder.rank_of(x)
    index = _drop_padded_indices(ctx, index, builder.shape_of(x)[dim])
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


@register_rule(aten.slice_scatter.default)
def _slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    shape = builder.shape_of(x)
    dim %= len(shape)
    size = shape[dim]
    start = 0 if start is None else start
    if start < 0 and step == 1 and ctx.extent(ctx.operand_metas[0], dim) is not None:
        return _scatter_from_actual_end(ctx, x, src, dim, start)
    start = min(max(start + size if start < 0 else start, 0), size)
    return _strided_scatter(x, src, dim, start, step)


def _scatter_from_actual_end(ctx, x, src, dim: int, start: int):
    """``x`` with ``src`` written from ``start`` counted from the actual end of a dimension padded to its
    bucket (the backward of a slice or select from the end), a position known when the program runs."""
    zero = builder.constant(0, torch.int32, ())
    first = hlo.maximum(hlo.add(ctx.extent(ctx.operand_metas[0], dim), builder.constant(start, torch.int32, ())),
                        zero)
    starts = [first if d == dim else zero for d in range(builder.rank_of(x))]
    return hlo.dynamic_update_slice(x, builder.convert(src, builder.dtype_of(x)), starts)


@register_rule(aten.select_scatter.default)
def _select_scatter(ctx, x, src, dim, index):
    shape = builder.shape_of(x)
    dim %= len(shape)
    src = builder.reshape(src, (*shape[:dim], 1, *shape[dim + 1 :]))
    if index < 0 and ctx.extent(ctx.operand_metas[0], dim) is not None:
        return _scatter_from_actual_end(ctx, x, src, dim, index)
    index = index + shape[dim] if index < 0 else index
    return _strided_scatter(x, src, dim, index, 1)


@register_rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(ctx, x, mask, value):
    shape, dtype = ctx.aval_out.shape, ctx.aval_out.dtype
    mask = builder.broadcast_to(builder.convert(mask, torch.bool), shape)
    fill = _scalar_or_tensor(value, dtype, shape)
    return builder.select(mask, fill, builder.broadcast_to(builder.convert(x, dtype), shape))


# --- index_reduce, put, masked_scatter, nonzero_static, narrow_copy, unbind_copy ------------------------------


@register_rule(aten.index_reduce.default)
def _index_reduce(ctx, x, dim, index, source, reduce, include_self=True):
    """``index_reduce``: like ``scatter_reduce`` but on whole slices along ``dim``. Without ``include_self`` the
    targeted slices start from the reduction's identity; ``mean`` divides by how many values landed."""
    dtype = builder.dtype_of(x)
    identities = {"prod": 1, "mean": 0, "amax": builder.min_value(dtype), "amin": builder.max_value(dtype)}
    combiners = {"prod": _multiply, "mean": _add, "amax": _maximum, "amin": _minimum}
    if reduce not in combiners:
        raise UnsupportedOpError(f"index_reduce with reduce={reduce!r} is not supported")
    x, dim, index, updates_shape = _slices_along(x, dim, index)
    shape = builder.shape_of(x)
    source = builder.reshape(builder.convert(source, dtype), updates_shape)
    where = [None] * dim + [index]
    base = x
    if not include_self:
        hit = _put(builder.constant(False, torch.bool, shape), where, builder.constant(True, torch.bool, updates_shape),
                   _replace)
        base = builder.select(hit, builder.constant(identities[reduce], dtype, shape), x)
    out = _put(base, where, source, combiners[reduce])
    if reduce == "mean":
        counts = _put(builder.constant(1 if include_self else 0, dtype, shape), where,
                      builder.constant(1, dtype, updates_shape), _add)
        zero = builder.constant(0, dtype, shape)
        counts = builder.select(builder.compare(counts, zero, "EQ"), builder.constant(1, dtype, shape), counts)
        out = _divide_by_positive(out, counts)
    return builder.reshape(out, ctx.aval_out.shape)


@register_rule(aten.put.default)
def _put_flat(ctx, x, index, source, accumulate=False):
    """``Tensor.put``: ``x`` seen as a flat vector, updated at ``index`` (negative indices wrap)."""
    shape = builder.shape_of(x)
    size = builder.numel(shape)
    count = builder.numel(builder.shape_of(index))
    flat = builder.reshape(x, (size,))
    index = builder.reshape(index, (count,))
    source = builder.reshape(source, (count,))
    out = _put(flat, [index], source, _add if accumulate else _replace)
    return builder.reshape(out, shape)


@register_rule(aten.masked_scatter.default)
def _masked_scatter(ctx, x, mask, source):
    """Each True position of ``mask`` (row-major) takes the next element of ``source``: the element whose
    index is the number of True positions before it (a prefix sum), gathered from the flattened source."""
    shape, dtype = ctx.aval_out.shape, ctx.aval_out.dtype
    size = builder.numel(shape)
    x = builder.reshape(builder.broadcast_to(builder.convert(x, dtype), shape), (size,))
    mask = builder.reshape(builder.broadcast_to(builder.convert(mask, torch.bool), shape), (size,))
    available = builder.numel(builder.shape_of(source))
    if available == 0 or size == 0:
        return builder.reshape(x, shape)
    source = builder.reshape(builder.convert(source, dtype), (available,))
    taken = _take(source, [_clamped_rank(mask, available)])
    return builder.reshape(builder.select(mask, taken, x), shape)


@register_rule(aten.masked_scatter_backward.default)
def _masked_scatter_backward(ctx, grad, mask, sizes):
    """The gradient of ``masked_scatter``'s source: the gradient at the i-th True position goes to source
    element i, the rest of the source gets zeros. Lanes that are False go to a spare slot, then dropped."""
    shape = builder.shape_of(grad)
    dtype = builder.dtype_of(grad)
    size = builder.numel(shape)
    available = builder.numel(ctx.aval_out.shape)
    grad = builder.reshape(grad, (size,))
    mask = builder.reshape(builder.broadcast_to(builder.convert(mask, torch.bool), shape), (size,))
    target = builder.select(mask, _rank_among_true(mask), builder.constant(available, torch.int64, (size,)))
    spare = _put(builder.constant(0, dtype, (available + 1,)), [target], grad, _replace)
    out = builder.slice_static(spare, [0], [available], [1])
    return builder.reshape(out, ctx.aval_out.shape)


@register_rule(aten.nonzero_static.default)
def _nonzero_static(ctx, x, *, size, fill_value=-1):
    """The coordinates of the first ``size`` nonzero elements (row-major), rows past the count filled with
    ``fill_value``: row ``rank among nonzeros`` of the result takes each nonzero element's coordinates."""
    shape = builder.shape_of(x)
    rank = len(shape)
    out_shape = ctx.aval_out.shape
    numel = builder.numel(shape)
    if rank == 0 or numel == 0 or size == 0:  # no coordinates to write (a 0-d input has rows of width 0)
        return builder.constant(fill_value, torch.int64, out_shape)
    flat = builder.reshape(builder.convert(x, torch.bool), (numel,))
    rows = _rank_among_true(flat)
    in_range = hlo.and_(flat, builder.compare(rows, builder.constant(size, torch.int64, (numel,)), "LT"))
    rows = builder.select(in_range, rows, builder.constant(size, torch.int64, (numel,)))
    columns = [builder.reshape(builder.iota(shape, torch.int64, d), (numel, 1)) for d in range(rank)]
    coordinates = builder.concatenate(columns, 1)
    spare = _put(builder.constant(fill_value, torch.int64, (size + 1, rank)), [rows], coordinates, _replace)
    return builder.slice_static(spare, [0, 0], [size, rank], [1, 1])


@register_rule(aten.narrow_copy.default)
def _narrow_copy(ctx, x, dim, start, length):
    shape = builder.shape_of(x)
    dim %= len(shape)
    start = start + shape[dim] if start < 0 else start
    starts, limits = [0] * len(shape), list(shape)
    starts[dim], limits[dim] = start, start + length
    return builder.slice_static(x, starts, limits, [1] * len(shape))


@register_rule(aten.unbind_copy.int)
def _unbind_copy(ctx, x, dim=0):
    shape = builder.shape_of(x)
    dim %= len(shape)
    pieces = []
    for i in range(shape[dim]):
        starts, limits = [0] * len(shape), list(shape)
        starts[dim], limits[dim] = i, i + 1
        piece = builder.slice_static(x, starts, limits, [1] * len(shape))
        pieces.append(builder.reshape(piece, shape[:dim] + shape[dim + 1 :]))
    return pieces
