"""Views and shape manipulation. Values are immutable in StableHLO, so every view is a new value whose
shape the traced graph already knows (``ctx.aval_out``)."""

from __future__ import annotations

import math

import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import tensor_type

aten = torch.ops.aten
prims = torch.ops.prims


@register_rule(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.view_copy.default,
    prims.squeeze.default,
    prims.view_of.default,
)
def _reshape(ctx, x, *args, **kwargs):
    return builder.reshape(x, ctx.aval_out.shape)


@register_rule(aten.permute.default, aten.permute_copy.default)
def _permute(ctx, x, dims):
    rank = builder.rank_of(x)
    return builder.transpose(x, [d % rank if rank else 0 for d in dims])


@register_rule(aten.t.default, aten.numpy_T.default)
def _t(ctx, x):
    rank = builder.rank_of(x)
    return builder.transpose(x, list(range(rank))[::-1])


@register_rule(aten.transpose.int)
def _transpose(ctx, x, dim0, dim1):
    rank = builder.rank_of(x)
    if rank == 0:
        return x
    perm = list(range(rank))
    perm[dim0 % rank], perm[dim1 % rank] = perm[dim1 % rank], perm[dim0 % rank]
    return builder.transpose(x, perm)


@register_rule(aten.expand.default, aten.expand_copy.default)
def _expand(ctx, x, size, implicit=False):
    return builder.broadcast_to(x, ctx.aval_out.shape)


def _normalize_range(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end


@register_rule(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(ctx, x, dim=0, start=None, end=None, step=1):
    shape = builder.shape_of(x)
    dim %= len(shape)
    if start is not None and start < 0 and ctx.extent(ctx.operand_metas[0], dim) is not None:
        return _from_actual_end(ctx, x, dim, start, ctx.aval_out.shape)
    if 2 in ctx.runtime_scalars:  # a start computed from runtime sizes (the backward of a concatenation)
        zero = builder.constant(0, torch.int32, ())
        first = hlo.maximum(builder.convert(ctx.runtime_scalars[2], torch.int32), zero)
        starts = [first if d == dim else zero for d in range(len(shape))]
        return hlo.dynamic_slice(x, starts, list(ctx.aval_out.shape))
    lo, hi = _normalize_range(shape[dim], start, end)
    starts = [0] * len(shape)
    limits = list(shape)
    strides = [1] * len(shape)
    starts[dim], limits[dim], strides[dim] = lo, hi, step
    return builder.slice_static(x, starts, limits, strides)


def _from_actual_end(ctx, x, dim: int, start: int, result_shape) -> ir.Value:
    """The elements of ``x`` from ``start`` (negative: counted from the end) along a dimension padded to its
    bucket, in a bucketed program: counted from the actual end, not the padded one, so the window starts at a
    position known only when the program runs."""
    extent = ctx.extent(ctx.operand_metas[0], dim)
    zero = builder.constant(0, torch.int32, ())
    first = hlo.maximum(hlo.add(extent, builder.constant(start, torch.int32, ())), zero)
    starts = [first if d == dim else zero for d in range(builder.rank_of(x))]
    return hlo.dynamic_slice(x, starts, list(result_shape))


@register_rule(aten.select.int, aten.select_copy.int)
def _select(ctx, x, dim, index):
    shape = builder.shape_of(x)
    dim %= len(shape)
    if index < 0 and ctx.extent(ctx.operand_metas[0], dim) is not None:
        kept = (*shape[:dim], 1, *shape[dim + 1:])
        return builder.reshape(_from_actual_end(ctx, x, dim, index, kept), ctx.aval_out.shape)
    index = index + shape[dim] if index < 0 else index
    starts = [0] * len(shape)
    limits = list(shape)
    starts[dim], limits[dim] = index, index + 1
    sliced = builder.slice_static(x, starts, limits, [1] * len(shape))
    return builder.reshape(sliced, ctx.aval_out.shape)


@register_rule(aten.cat.default)
def _cat(ctx, tensors, dim=0):
    dtype = ctx.aval_out.dtype
    rank = ctx.aval_out.rank
    # torch.cat skips legacy 1-d empty tensors whatever the other inputs' rank.
    parts = [builder.convert(t, dtype) for t in tensors if builder.shape_of(t) != (0,) or rank == 1]
    if not parts:
        return builder.constant(0, dtype, ctx.aval_out.shape)
    return builder.concatenate(parts, dim % rank)


@register_rule(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def _split_with_sizes(ctx, x, split_sizes, dim=0):
    return _split(x, list(split_sizes), dim)


@register_rule(aten.split.Tensor, aten.split_copy.Tensor)
def _split_tensor(ctx, x, split_size, dim=0):
    size = builder.shape_of(x)[dim % builder.rank_of(x)]
    sizes = [min(split_size, size - start) for start in range(0, size, split_size)] if split_size else [size]
    return _split(x, sizes or [0], dim)


def _split(x, sizes: list[int], dim: int) -> list:
    shape = builder.shape_of(x)
    dim %= len(shape)
    outputs, offset = [], 0
    for size in sizes:
        starts = [0] * len(shape)
        limits = list(shape)
        starts[dim], limits[dim] = offset, offset + size
        outputs.append(builder.slice_static(x, starts, limits, [1] * len(shape)))
        offset += size
    return outputs


@register_rule(aten.unbind.int)
def _unbind(ctx, x, dim=0):
    shape = builder.shape_of(x)
    dim %= len(shape)
    pieces = _split(x, [1] * shape[dim], dim)
    return [builder.reshape(p, shape[:dim] + shape[dim + 1 :]) for p in pieces]


@register_rule(aten.flip.default)
def _flip(ctx, x, dims):
    rank = builder.rank_of(x)
    if not dims or rank == 0:
        return x
    return hlo.reverse(x, sorted(d % rank for d in dims))


@register_rule(aten.constant_pad_nd.default)
def _constant_pad_nd(ctx, x, pad, value=0):
    rank = builder.rank_of(x)
    low, high = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):  # pad lists (left, right) pairs from the last dimension backwards
        dim = rank - 1 - i
        low[dim], high[dim] = pad[2 * i], pad[2 * i + 1]
    padding = builder.constant(value, builder.dtype_of(x), ())
    padded = hlo.pad(x, padding, low, high, [0] * rank)
    for dim in range(rank):
        extent = ctx.extent(ctx.operand_metas[0], dim)
        if extent is not None and (low[dim] or high[dim]):
            padded = _fill_past_actual(padded, dim, low[dim], extent, padding)
    return padded


def _fill_past_actual(padded, dim: int, low: int, extent, padding):
    """``padded`` with ``padding`` everywhere along ``dim`` outside ``[low, low + extent)``: the input's own
    padding to its bucket (past its actual size ``extent``) sits where the high padding belongs."""
    shape = builder.shape_of(padded)
    positions = builder.iota(shape, torch.int32, dim)
    end = builder.broadcast_to(hlo.add(extent, builder.constant(low, torch.int32, ())), shape)
    inside = hlo.and_(builder.compare(positions, builder.constant(low, torch.int32, shape), "GE"),
                      builder.compare(positions, end, "LT"))
    return builder.select(inside, padded, builder.broadcast_to(padding, shape))


@register_rule(aten.repeat.default)
def _repeat(ctx, x, repeats):
    shape = builder.shape_of(x)
    shape = (1,) * (len(repeats) - len(shape)) + shape
    x = builder.reshape(x, shape)
    # Broadcast to [r0, s0, r1, s1, ...] then merge each pair: tiles follow each other, as in torch.
    expanded_shape = [d for pair in zip(repeats, shape, strict=True) for d in pair]
    dims = [2 * i + 1 for i in range(len(shape))]
    tiled = builder.broadcast_in_dims(x, expanded_shape, dims)
    return builder.reshape(tiled, ctx.aval_out.shape)


def _embed(src, shape, starts, steps):
    """Place ``src`` at ``starts + i * steps`` of a zero tensor of ``shape``; also return where it went.

    One ``pad`` with interior padding does it (the mask is the same pad applied to an all-true tensor), so
    a scatter into a strided window never needs a real scatter.
    """
    src_shape = builder.shape_of(src)
    low = list(starts)
    interior = [step - 1 for step in steps]
    high = [
        size - (start + (n - 1) * step + 1)
        for size, start, step, n in zip(shape, starts, steps, src_shape, strict=True)
    ]
    zero = builder.constant(0, builder.dtype_of(src), ())
    placed = hlo.pad(src, zero, low, high, interior)
    mask = hlo.pad(builder.constant(True, torch.bool, src_shape), builder.constant(False, torch.bool, ()),
                   low, high, interior)
    return placed, mask


def _strided_scatter(base, src, starts, steps):
    """``base`` with the strided window ``starts[k] + i * steps[k]`` replaced by ``src``."""
    src = builder.convert(src, builder.dtype_of(base))
    if math.prod(builder.shape_of(src)) == 0:
        return base
    if all(step == 1 for step in steps):
        indices = [builder.constant(start, torch.int64, ()) for start in starts]
        return hlo.dynamic_update_slice(base, src, indices)
    placed, mask = _embed(src, builder.shape_of(base), starts, steps)
    return builder.select(mask, placed, base)


def _diagonal_layout(shape, offset, dim1, dim2):
    """How a diagonal sits in ``x`` once ``dim1, dim2`` are moved last and merged into one dimension.

    Returns (permutation, diagonal length, first flat index, flat step)."""
    rank = len(shape)
    dim1, dim2 = dim1 % rank, dim2 % rank
    rows, cols = shape[dim1], shape[dim2]
    if offset >= 0:
        length = max(0, min(rows, cols - offset))
        first = offset
    else:
        length = max(0, min(rows + offset, cols))
        first = -offset * cols
    perm = [d for d in range(rank) if d not in (dim1, dim2)] + [dim1, dim2]
    return perm, length, first, cols + 1


@register_rule(aten.diagonal.default, aten.diagonal_copy.default)
def _diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    shape = builder.shape_of(x)
    perm, length, first, step = _diagonal_layout(shape, offset, dim1, dim2)
    moved = builder.transpose(x, perm)
    batch = builder.shape_of(moved)[:-2]
    flat = builder.reshape(moved, (*batch, shape[perm[-2]] * shape[perm[-1]]))
    if length == 0:
        first, step = 0, 1
    starts = [0] * len(batch) + [first]
    limits = [*list(batch), first + (length - 1) * step + 1 if length else 0]
    return builder.slice_static(flat, starts, limits, [1] * len(batch) + [step])


@register_rule(aten.diagonal_scatter.default)
def _diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    shape = builder.shape_of(x)
    perm, length, first, step = _diagonal_layout(shape, offset, dim1, dim2)
    if length == 0:
        return x
    moved = builder.transpose(x, perm)
    moved_shape = builder.shape_of(moved)
    batch = moved_shape[:-2]
    flat = builder.reshape(moved, (*batch, moved_shape[-2] * moved_shape[-1]))
    updated = _strided_scatter(flat, src, [0] * len(batch) + [first], [1] * len(batch) + [step])
    inverse = [perm.index(d) for d in range(len(shape))]
    return builder.transpose(builder.reshape(updated, moved_shape), inverse)


@register_rule(aten.roll.default)
def _roll(ctx, x, shifts, dims=()):
    shifts, dims = list(shifts), list(dims)
    if not dims:  # roll the flattened tensor, then restore the shape
        flat = builder.reshape(x, (math.prod(builder.shape_of(x)),))
        return builder.reshape(_roll_dims(flat, shifts, [0]), builder.shape_of(x))
    return _roll_dims(x, shifts, dims)


def _roll_dims(x, shifts, dims):
    for shift, dim in zip(shifts, dims, strict=True):
        shape = builder.shape_of(x)
        dim %= len(shape)
        size = shape[dim]
        if size == 0 or shift % size == 0:
            continue
        cut = size - shift % size  # the last ``shift`` elements move to the front
        starts, limits, strides = [0] * len(shape), list(shape), [1] * len(shape)
        tail_starts, head_limits = list(starts), list(limits)
        tail_starts[dim], head_limits[dim] = cut, cut
        tail = builder.slice_static(x, tail_starts, limits, strides)
        head = builder.slice_static(x, starts, head_limits, strides)
        x = builder.concatenate([tail, head], dim)
    return x


@register_rule(aten.unfold.default, aten.unfold_copy.default)
def _unfold(ctx, x, dim, size, step):
    """Windows of ``size`` every ``step`` along ``dim``, as a new last dimension: one strided slice per
    position in the window, concatenated."""
    shape = builder.shape_of(x)
    out_shape = ctx.aval_out.shape
    if not shape:
        return builder.reshape(x, out_shape)
    dim %= len(shape)
    count = out_shape[dim]
    if count == 0 or size == 0:
        return builder.constant(0, builder.dtype_of(x), out_shape)
    pieces = []
    for offset in range(size):
        starts, limits, strides = [0] * len(shape), list(shape), [1] * len(shape)
        starts[dim], limits[dim], strides[dim] = offset, offset + (count - 1) * step + 1, step
        piece = builder.slice_static(x, starts, limits, strides)
        pieces.append(builder.reshape(piece, (*builder.shape_of(piece), 1)))
    return builder.concatenate(pieces, len(shape))


@register_rule(aten.view.dtype)
def _view_dtype(ctx, x, dtype):
    """Reinterpret the bits; a size change splits or merges the last dimension, as torch does."""
    source = builder.dtype_of(x)
    target = ctx.aval_out.dtype
    if source.is_complex:
        # XLA bitcasts no complex type: the (real, imaginary) pairs are the complex value's bits
        pairs = builder.as_float_pairs(x)
        merged = builder.reshape(pairs, (*builder.shape_of(x)[:-1], builder.shape_of(x)[-1] * 2))
        return _view_dtype(ctx, merged, target) if target is not source.to_real() else merged
    if target.is_complex:
        part = target.to_real()
        shape = ctx.aval_out.shape
        floats = x if source is part else _bitcast(x, source, part, (*shape[:-1], shape[-1] * 2))
        return builder.from_float_pairs(builder.reshape(floats, (*shape, 2)))
    return _bitcast(x, source, target, ctx.aval_out.shape)


def _bitcast(x, source: torch.dtype, target: torch.dtype, out_shape) -> ir.Value:
    """``x``'s bits as ``target`` values of ``out_shape`` (the last dimension split or merged by the ratio of
    the item sizes)."""
    if source is torch.bool or target is torch.bool:
        if source.itemsize != target.itemsize:
            raise UnsupportedOpError(f"view of {source} as {target}")
        return builder.convert(x, target)  # a bool byte holds 0 or 1
    shape = builder.shape_of(x)
    if source.itemsize == target.itemsize:
        return hlo.bitcast_convert(tensor_type(shape, target), x)
    if source.itemsize > target.itemsize:
        ratio = source.itemsize // target.itemsize
        split = hlo.bitcast_convert(tensor_type((*shape, ratio), target), x)
        return builder.reshape(split, out_shape)
    ratio = target.itemsize // source.itemsize
    grouped = builder.reshape(x, (*shape[:-1], shape[-1] // ratio, ratio))
    return hlo.bitcast_convert(tensor_type(out_shape, target), grouped)


def _static_ints(values) -> list[int] | None:
    if any(isinstance(v, torch.SymInt) for v in values):
        return None
    return [int(v) for v in values]


def _strided_layout(meta, shape) -> tuple[list[int], int]:
    """The strides and storage offset the eager tensor behind ``meta`` has (concrete ``shape``)."""
    strides = _static_ints(meta.stride()) if isinstance(meta, torch.Tensor) else None
    offset = _static_ints([meta.storage_offset()]) if isinstance(meta, torch.Tensor) else None
    if strides is None:  # symbolic layout: the functional value is dense, so assume row-major
        strides = [math.prod(shape[k + 1 :]) for k in range(len(shape))]
    return strides, offset[0] if offset else 0


def _positions(shape, strides, offset) -> np.ndarray:
    """The storage position of every element of a strided tensor, as an array of ``shape``."""
    pos = np.full(tuple(shape), offset, dtype=np.int64)
    for k, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        index_shape = [1] * len(shape)
        index_shape[k] = size
        pos = pos + np.arange(size, dtype=np.int64).reshape(index_shape) * stride
    return pos


def _as_strided_indices(ctx, x, size, stride, storage_offset) -> np.ndarray:
    """For each element of ``as_strided(x, size, stride, storage_offset)``, the flat (row-major) index of
    the element of ``x`` that shares its storage position."""
    shape = builder.shape_of(x)
    in_strides, in_offset = _strided_layout(ctx.operand_metas[0], shape)
    offset = in_offset if storage_offset is None else storage_offset
    held = _positions(shape, in_strides, in_offset).reshape(-1)
    wanted = _positions(size, stride, offset).reshape(-1)
    order = np.argsort(held, kind="stable")
    ordered = held[order]
    found = np.searchsorted(ordered, wanted)
    inside = found < len(ordered)
    if not (inside.all() and (ordered[np.minimum(found, len(ordered) - 1)] == wanted).all()):
        raise UnsupportedOpError(
            "as_strided reads storage outside its input tensor; tpucompile lowers views of values, not memory"
        )
    return order[found].reshape(tuple(size))


def _as_slice(indices: np.ndarray, shape) -> tuple[list[int], list[int]] | None:
    """(starts, steps) when ``indices`` (flat indices into ``shape``) select a strided window of it."""
    if indices.ndim != len(shape) or indices.size == 0:
        return None
    origin = np.unravel_index(int(indices.flat[0]), shape)
    starts = [int(c) for c in origin]
    steps = []
    for k in range(indices.ndim):
        if indices.shape[k] == 1:
            steps.append(1)
            continue
        neighbour = [0] * indices.ndim
        neighbour[k] = 1
        coords = np.unravel_index(int(indices[tuple(neighbour)]), shape)
        delta = [int(c) - s for c, s in zip(coords, starts, strict=True)]
        if delta[k] <= 0 or any(d for j, d in enumerate(delta) if j != k):
            return None
        steps.append(delta[k])
    grids = np.meshgrid(*[s + np.arange(n) * t for s, n, t in zip(starts, indices.shape, steps, strict=True)],
                        indexing="ij")
    if any(int(g.max(initial=0)) >= size for g, size in zip(grids, shape, strict=True)):
        return None
    if not np.array_equal(np.ravel_multi_index(grids, shape), indices):
        return None
    return starts, steps


def _as_flat_range(indices: np.ndarray) -> tuple[int, int] | None:
    """(start, step) when the row-major flattening of ``indices`` is an arithmetic sequence."""
    flat = indices.reshape(-1)
    if flat.size == 0:
        return None
    step = int(flat[1] - flat[0]) if flat.size > 1 else 1
    if step <= 0 or not np.array_equal(flat, flat[0] + step * np.arange(flat.size)):
        return None
    return int(flat[0]), step


def gather_flat(x: ir.Value, indices: np.ndarray) -> ir.Value:
    """``x.reshape(-1)[indices]`` for a constant index array (any shape)."""
    flat = builder.reshape(x, (math.prod(builder.shape_of(x)),))
    out_shape = tuple(indices.shape)
    start_indices = builder.dense_constant(torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)))
    start_indices = builder.reshape(start_indices, (*out_shape, 1))
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[],
        collapsed_slice_dims=[0],
        operand_batching_dims=[],
        start_indices_batching_dims=[],
        start_index_map=[0],
        index_vector_dim=len(out_shape),
    )
    return hlo.gather(flat, start_indices, numbers, [1], indices_are_sorted=False,
                      results=[tensor_type(out_shape, builder.dtype_of(x))])


@register_rule(aten.as_strided.default, aten.as_strided_copy.default)
def _as_strided(ctx, x, size, stride, storage_offset=None):
    """``as_strided`` over the eager layout of ``x`` (from its traced strides). The element map is
    computed at compile time; it lowers to a reshape or a strided slice when it is one, else to a gather."""
    size, stride = list(size), list(stride)
    out_shape = tuple(size)
    if math.prod(out_shape) == 0:
        return builder.constant(0, builder.dtype_of(x), out_shape)
    indices = _as_strided_indices(ctx, x, size, stride, storage_offset)
    shape = builder.shape_of(x)
    window = _as_slice(indices, shape)
    if window is not None:
        starts, steps = window
        limits = [s + (n - 1) * t + 1 for s, n, t in zip(starts, out_shape, steps, strict=True)]
        return builder.slice_static(x, starts, limits, steps)
    flat_range = _as_flat_range(indices)
    if flat_range is not None:
        start, step = flat_range
        flat = builder.reshape(x, (math.prod(shape),))
        count = indices.size
        picked = builder.slice_static(flat, [start], [start + (count - 1) * step + 1], [step])
        return builder.reshape(picked, out_shape)
    return gather_flat(x, indices)


@register_rule(aten.as_strided_scatter.default)
def _as_strided_scatter(ctx, x, src, size, stride, storage_offset=None):
    """``x`` with the elements that ``as_strided(x, size, stride, storage_offset)`` would view replaced by
    ``src``: each element of ``x`` gathers the (last) element of ``src`` written to it, if any."""
    size = list(size)
    if math.prod(size) == 0:
        return x
    indices = _as_strided_indices(ctx, x, size, list(stride), storage_offset)
    shape = builder.shape_of(x)
    src = builder.convert(src, builder.dtype_of(x))
    window = _as_slice(indices, shape)
    if window is not None:
        return _strided_scatter(x, src, *window)
    source = np.full(math.prod(shape), -1, dtype=np.int64)
    source[indices.reshape(-1)] = np.arange(indices.size, dtype=np.int64)
    picked = gather_flat(src, np.maximum(source, 0).reshape(shape))
    written = builder.dense_constant(torch.from_numpy(source.reshape(shape) >= 0))
    return builder.select(written, picked, x)
