"""Searching sorted sequences and binning: ``searchsorted``, ``bucketize``, ``histc``, ``histogram``,
``histogramdd`` and ``segment_reduce`` (with its backward).

All have static result shapes. The shared piece is a binary search written out as ``bit_length(M)`` rounds
of gather-and-compare, which reproduces PyTorch's CPU loop step for step (``mid = start + (end - start) / 2``,
moving right on ``!(seq[mid] >= v)``, or ``!(seq[mid] > v)`` for the right side), so that NaNs and unsorted
input land where eager puts them too. Histograms map each element to a flat bin index (a spare bin past the
end for elements that are skipped) and scatter-add their weights; the bin edges follow PyTorch's linspace,
which on CPU evaluates ``start + step * i`` with a fused multiply-add (emulated here in float64).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten
Value = ir.Value


def _i64(value: int, shape: Sequence[int] = ()) -> Value:
    return builder.constant(value, torch.int64, shape)


# --- binary search ------------------------------------------------------------------------------------------


def _search_rows(seq: Value, values: Value, right: bool) -> Value:
    """Insertion points (int64) of each row of ``values`` (B, N) in the same row of ``seq`` (B, M)."""
    length = builder.shape_of(seq)[1]
    shape = builder.shape_of(values)
    start = _i64(0, shape)
    if length == 0 or builder.numel(shape) == 0:
        return start
    end = _i64(length, shape)
    one, last = _i64(1, shape), _i64(length - 1, shape)
    for _ in range(length.bit_length()):
        active = builder.compare(start, end, "LT")
        mid = hlo.add(start, hlo.shift_right_arithmetic(hlo.subtract(end, start), one))
        probe = builder.take_along(seq, 1, hlo.clamp(_i64(0, shape), mid, last))
        stays_left = builder.compare(probe, values, "GT" if right else "GE")
        go_right = hlo.and_(active, hlo.not_(stays_left))
        start = builder.select(go_right, hlo.add(mid, one), start)
        end = builder.select(hlo.and_(active, stays_left), mid, end)
    return start


def search_sorted(seq: Value, values: Value, right: bool) -> Value:
    """``torch.searchsorted(seq, values, right=right)`` (int64) for same-dtype operands: a 1-d ``seq`` serves
    every value; otherwise ``seq`` (..., M) and ``values`` (..., N) agree on the leading dims."""
    seq_shape, value_shape = builder.shape_of(seq), builder.shape_of(values)
    length = seq_shape[-1]
    if len(seq_shape) == 1:
        rows, count = 1, builder.numel(value_shape)
    else:
        rows, count = builder.numel(seq_shape[:-1]), value_shape[-1]
    found = _search_rows(builder.reshape(seq, (rows, length)), builder.reshape(values, (rows, count)), right)
    return builder.reshape(found, value_shape)


def _common_dtype(seq_meta, value) -> torch.dtype:
    if isinstance(value, ir.Value):
        return torch.promote_types(seq_meta.dtype, builder.dtype_of(value))
    return torch.result_type(seq_meta, value)


def _as_operand(value, dtype: torch.dtype) -> Value:
    if isinstance(value, ir.Value):
        return builder.convert(value, dtype)
    return builder.constant(value, dtype, ())


@register_rule(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted(ctx, seq, values, *, out_int32=False, right=False, side=None, sorter=None):
    right = side == "right" if side is not None else right
    dtype = _common_dtype(ctx.operand_metas[0], values)
    seq, values = builder.convert(seq, dtype), _as_operand(values, dtype)
    if sorter is not None and builder.numel(builder.shape_of(seq)) > 0:
        seq = builder.take_along(seq, builder.rank_of(seq) - 1, sorter)
    return builder.convert(search_sorted(seq, values, right), ctx.aval_out.dtype)


@register_rule(aten.bucketize.Tensor, aten.bucketize.Scalar)
def _bucketize(ctx, values, boundaries, *, out_int32=False, right=False):
    dtype = _common_dtype(ctx.operand_metas[1], values)
    boundaries, values = builder.convert(boundaries, dtype), _as_operand(values, dtype)
    return builder.convert(search_sorted(boundaries, values, right), ctx.aval_out.dtype)


# --- histograms ---------------------------------------------------------------------------------------------


def _scalar_slice(vector: Value, index: int) -> Value:
    return builder.reshape(builder.slice_static(vector, [index], [index + 1], [1]), ())


def _extremes(column: Value) -> tuple[Value, Value]:
    """(min, max) of a 1-d tensor as 0-d values."""
    dtype = builder.dtype_of(column)
    low = builder.reduce([column], [builder.constant(builder.max_value(dtype), dtype)], [0],
                         lambda acc, el: [hlo.minimum(acc[0], el[0])])[0]
    high = builder.reduce([column], [builder.constant(builder.min_value(dtype), dtype)], [0],
                          lambda acc, el: [hlo.maximum(acc[0], el[0])])[0]
    return low, high


def _widen_if_equal(low: Value, high: Value, by: float) -> tuple[Value, Value]:
    """float64 ``(low - by, high + by)`` where ``low == high``, as PyTorch widens an empty range."""
    low, high = builder.convert(low, torch.float64), builder.convert(high, torch.float64)
    equal = builder.compare(low, high, "EQ")
    delta = builder.constant(by, torch.float64)
    return builder.select(equal, hlo.subtract(low, delta), low), builder.select(equal, hlo.add(high, delta), high)


def _outer_edges(column: Value | None, bounds: tuple[float, float] | None, widen: float) -> tuple[Value, Value]:
    """float64 0-d outermost edges: ``bounds`` if given, else the data's extremes (0 and 1 with no data)."""
    if bounds is not None:
        low, high = builder.constant(bounds[0], torch.float64), builder.constant(bounds[1], torch.float64)
    elif column is not None and builder.numel(builder.shape_of(column)) > 0:
        low, high = _extremes(column)
    else:
        low, high = builder.constant(0.0, torch.float64), builder.constant(1.0, torch.float64)
    return _widen_if_equal(low, high, widen)


def _linspace(low: Value, high: Value, steps: int, dtype: torch.dtype) -> Value:
    """``torch.linspace(low, high, steps, dtype=dtype)`` from float64 0-d endpoints, as the CPU kernel computes
    it: ``start + step * i`` for the first half and ``end - step * (steps - 1 - i)`` for the rest, each a fused
    multiply-add (exact in float64 for float32 and bfloat16 operands, then rounded once)."""
    start, end = builder.convert(low, dtype), builder.convert(high, dtype)
    step = hlo.divide(hlo.subtract(end, start), builder.constant(steps - 1, dtype))
    wide = torch.float64
    shape = (steps,)
    index = builder.iota(shape, wide, 0)
    step_w = builder.broadcast_to(builder.convert(step, wide), shape)
    first = hlo.add(builder.broadcast_to(builder.convert(start, wide), shape), hlo.multiply(step_w, index))
    countdown = hlo.subtract(builder.constant(steps - 1, wide, shape), index)
    second = hlo.subtract(builder.broadcast_to(builder.convert(end, wide), shape), hlo.multiply(step_w, countdown))
    half = builder.compare(builder.iota(shape, torch.int64, 0), _i64(steps // 2, shape), "LT")
    return builder.convert(builder.select(half, first, second), dtype)


@dataclasses.dataclass
class _Axis:
    """One dimension of a histogram: its edges and how elements are mapped onto them."""

    edges: Value
    """(bins + 1,) edges in the input dtype."""
    linear: bool
    """Bin by linear interpolation between the outer edges (else by binary search over all edges)."""
    local_search: bool = True
    """With ``linear``: correct the interpolated bin against the neighbouring edges (``histogram``)."""


def _bin_of(values: Value, axis: _Axis) -> tuple[Value, Value]:
    """(bin index int64, in-range mask) of each element of the 1-d ``values`` along one histogram axis."""
    count = builder.shape_of(values)[0]
    edges = axis.edges
    total = builder.shape_of(edges)[0]
    dtype = builder.dtype_of(values)
    shape = (count,)
    left = builder.broadcast_to(_scalar_slice(edges, 0), shape)
    right = builder.broadcast_to(_scalar_slice(edges, total - 1), shape)
    inside = hlo.and_(builder.compare(values, left, "GE"), builder.compare(values, right, "LE"))
    if not axis.linear:
        position = hlo.subtract(search_sorted(edges, values, right=True), _i64(1, shape))
    else:
        scaled = hlo.multiply(hlo.subtract(values, left), builder.constant(total - 1, dtype, shape))
        position = builder.convert(hlo.divide(scaled, hlo.subtract(right, left)), torch.int64)
        if axis.local_search:
            position = _local_search(edges, values, position)
    last = _i64(total - 1, shape)
    position = builder.select(builder.compare(position, last, "EQ"), hlo.subtract(last, _i64(1, shape)), position)
    return position, inside


def _local_search(edges: Value, values: Value, guess: Value) -> Value:
    """``upper_bound(edges[max(0, g - 1):min(g + 2, E)], v) - 1``: the interpolated bin checked against the
    edges around it, as ``LINEAR_INTERPOLATION_WITH_LOCAL_SEARCH`` does."""
    shape = builder.shape_of(values)
    total = builder.shape_of(edges)[0]
    low = hlo.maximum(_i64(0, shape), hlo.subtract(guess, _i64(1, shape)))
    high = hlo.minimum(hlo.add(guess, _i64(2, shape)), _i64(total, shape))
    found = hlo.subtract(low, _i64(1, shape))
    for offset in (-1, 0, 1):
        k = hlo.add(guess, _i64(offset, shape))
        usable = hlo.and_(builder.compare(k, low, "GE"), builder.compare(k, high, "LT"))
        edge = builder.take_along(edges, 0, hlo.clamp(_i64(0, shape), k, _i64(total - 1, shape)))
        below = hlo.and_(usable, builder.compare(edge, values, "LE"))
        found = hlo.add(found, builder.convert(below, torch.int64))
    return found


def _histogram(points: Value, axes: Sequence[_Axis], weight: Value | None, density: bool,
               dtype: torch.dtype) -> Value:
    """The histogram (shape: bins per axis) of ``points`` (M, D) over ``axes``, in ``dtype``."""
    count = builder.shape_of(points)[0]
    bins = [builder.shape_of(a.edges)[0] - 1 for a in axes]
    cells = builder.numel(bins)
    accumulate = builder.accumulator_dtype(dtype)
    flat = _i64(0, (count,))
    inside = builder.constant(True, torch.bool, (count,))
    stride = cells
    for d, axis in enumerate(axes):
        stride //= bins[d]
        position, ok = _bin_of(_column(points, d), axis)
        flat = hlo.add(flat, hlo.multiply(position, _i64(stride, (count,))))
        inside = hlo.and_(inside, ok)
    flat = builder.select(inside, flat, _i64(cells, (count,)))
    if weight is None:
        updates = builder.constant(1, accumulate, (count,))
    else:
        updates = builder.convert(builder.reshape(weight, (count,)), accumulate)
    hist = builder.scatter_rows(builder.constant(0, accumulate, (cells + 1,)), builder.reshape(flat, (count, 1)),
                                updates, hlo.add)
    hist = builder.slice_static(hist, [0], [cells], [1])
    hist = builder.convert(hist, dtype)
    if density:
        total = builder.reduce_sum(hist, [0])
        hist = hlo.divide(hist, builder.broadcast_to(total, (cells,)))
        hist = builder.reshape(hist, bins)
        for d, axis in enumerate(axes):
            e = axis.edges
            widths = hlo.subtract(builder.slice_static(e, [1], [bins[d] + 1], [1]),
                                  builder.slice_static(e, [0], [bins[d]], [1]))
            hist = hlo.divide(hist, builder.broadcast_in_dims(widths, bins, [d]))
    return builder.reshape(hist, bins)


def _points(x: Value) -> Value:
    """``histogramdd``'s view of its input: (M, D) with D the last dim."""
    shape = builder.shape_of(x)
    return builder.reshape(x, (builder.numel(shape[:-1]), shape[-1]))


def _column(points: Value, d: int) -> Value:
    count = builder.shape_of(points)[0]
    return builder.reshape(builder.slice_static(points, [0, d], [count, d + 1], [1, 1]), (count,))


def _linear_edges(points: Value, bins: Sequence[int], bounds: Sequence[float] | None) -> list[Value]:
    """``_histogramdd_bin_edges``: per dim, linspace between the range (or the data's extremes, widened by
    0.5 on each side when equal)."""
    dtype = builder.dtype_of(points)
    edges = []
    for d, count in enumerate(bins):
        pair = None if bounds is None else (float(bounds[2 * d]), float(bounds[2 * d + 1]))
        low, high = _outer_edges(_column(points, d), pair, 0.5)
        edges.append(_linspace(low, high, count + 1, dtype))
    return edges


@register_rule(aten.histc.default)
def _histc(ctx, x, bins=100, min=0, max=0):
    dtype = builder.dtype_of(x)
    size = builder.numel(builder.shape_of(x))
    if size == 0:
        return builder.constant(0, dtype, (bins,))
    column = builder.reshape(x, (size,))
    if float(min) == float(max):
        low, high = _widen_if_equal(*_extremes(column), 1.0)
    else:
        low, high = builder.constant(float(min), torch.float64), builder.constant(float(max), torch.float64)
    axis = _Axis(_linspace(low, high, bins + 1, dtype), linear=True, local_search=False)
    return _histogram(builder.reshape(column, (size, 1)), [axis], None, False, dtype)


@register_rule(aten.histogram.bin_ct)
def _histogram_bin_ct(ctx, x, bins=100, *, range=None, weight=None, density=False):
    points = builder.reshape(x, (builder.numel(builder.shape_of(x)), 1))
    (edges,) = _linear_edges(points, [bins], range)
    hist = _histogram(points, [_Axis(edges, linear=True)], weight, density, builder.dtype_of(x))
    return hist, edges


@register_rule(aten.histogram.bins_tensor)
def _histogram_bins_tensor(ctx, x, bins, *, weight=None, density=False):
    points = builder.reshape(x, (builder.numel(builder.shape_of(x)), 1))
    hist = _histogram(points, [_Axis(bins, linear=False)], weight, density, builder.dtype_of(x))
    return hist, bins


@register_rule(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(ctx, x, bins, *, range=None, weight=None, density=False):
    return _linear_edges(_points(x), bins, range)


@register_rule(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(ctx, x, bins, *, range=None, weight=None, density=False):
    points = _points(x)
    axes = [_Axis(e, linear=True) for e in _linear_edges(points, bins, range)]
    return _histogram(points, axes, weight, density, builder.dtype_of(x))


@register_rule(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(ctx, x, bins, *, weight=None, density=False):
    axes = [_Axis(e, linear=False) for e in bins]
    return _histogram(_points(x), axes, weight, density, builder.dtype_of(x))


# --- segment_reduce -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Segments:
    """Where each element of ``data`` (viewed as (outer, L, inner)) goes: segment ``ids`` (outer, L), with
    ``count`` for elements in no segment, and the ``lengths`` (outer, count) of the segments."""

    ids: Value
    lengths: Value
    count: int
    outer: int
    inner: int
    span: int


def _segments(data_shape: Sequence[int], axis: int, lengths: Value | None, offsets: Value | None) -> _Segments:
    outer = builder.numel(data_shape[:axis])
    span = data_shape[axis]
    inner = builder.numel(data_shape[axis + 1 :])
    if lengths is not None:
        count = builder.shape_of(lengths)[-1]
        sizes = builder.reshape(builder.convert(lengths, torch.int64), (outer, count))
        (ends,) = builder.scan([sizes], [_i64(0)], 1, lambda acc, el: [hlo.add(acc[0], el[0])])
        starts = hlo.subtract(ends, sizes)
    elif offsets is not None:
        count = builder.shape_of(offsets)[-1] - 1
        bounds = builder.reshape(builder.convert(offsets, torch.int64), (outer, count + 1))
        starts = builder.slice_static(bounds, [0, 0], [outer, count], [1, 1])
        ends = builder.slice_static(bounds, [0, 1], [outer, count + 1], [1, 1])
        sizes = hlo.subtract(ends, starts)
    else:
        raise UnsupportedOpError("segment_reduce needs lengths or offsets")
    shape = (outer, span)
    positions = builder.iota(shape, torch.int64, 1)
    if count == 0:
        return _Segments(_i64(0, shape), sizes, count, outer, inner, span)
    ids = search_sorted(ends, positions, right=True)  # the first segment that ends after the position
    first = builder.take_along(starts, 1, hlo.minimum(ids, _i64(count - 1, shape)))
    valid = hlo.and_(builder.compare(ids, _i64(count, shape), "LT"), builder.compare(positions, first, "GE"))
    return _Segments(builder.select(valid, ids, _i64(count, shape)), sizes, count, outer, inner, span)


def _row_numbers(seg: _Segments) -> Value:
    """(outer, L, 2) coordinates ``[row, segment id]`` of each element."""
    shape = (seg.outer, seg.span)
    rows = builder.iota(shape, torch.int64, 0)
    return builder.concatenate([builder.reshape(v, (*shape, 1)) for v in (rows, seg.ids)], 2)


def _scatter_segments(seg: _Segments, base: Value, updates: Value, combiner) -> Value:
    """Combine ``updates`` (outer, L, inner) into ``base`` (outer, count + 1, inner) by segment."""
    numbers = hlo.ScatterDimensionNumbers.get(
        update_window_dims=[2], inserted_window_dims=[0, 1], input_batching_dims=[],
        scatter_indices_batching_dims=[], scattered_dims_to_operand_dims=[0, 1], index_vector_dim=2,
    )
    return builder.scatter(base, _row_numbers(seg), updates, numbers, combiner)


def _gather_segments(seg: _Segments, table: Value) -> Value:
    """``table`` (outer, count, inner) read back per element: (outer, L, inner); elements in no segment read
    the last segment (callers mask them)."""
    shape = (seg.outer, seg.span)
    ids = hlo.minimum(seg.ids, _i64(max(seg.count - 1, 0), shape))
    rows = builder.iota(shape, torch.int64, 0)
    starts = builder.concatenate([builder.reshape(v, (*shape, 1)) for v in (rows, ids)], 2)
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[2], collapsed_slice_dims=[0, 1], operand_batching_dims=[], start_indices_batching_dims=[],
        start_index_map=[0, 1], index_vector_dim=2,
    )
    return hlo.gather(table, starts, numbers, [1, 1, seg.inner])


def _segment_sizes(seg: _Segments, dtype: torch.dtype) -> Value:
    sizes = builder.convert(seg.lengths, dtype)
    return builder.broadcast_in_dims(sizes, (seg.outer, seg.count, seg.inner), [0, 1])


_SEGMENT_IDENTITY = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "max": float("-inf"), "min": float("inf")}


def _segment_combiner(reduce: str):
    if reduce in ("sum", "mean"):
        return hlo.add
    if reduce == "prod":
        return hlo.multiply
    if reduce == "max":
        return hlo.maximum  # propagates NaN, as eager's ``isnan(v) ? v : max(acc, v)`` does
    if reduce == "min":
        return hlo.minimum
    raise UnsupportedOpError(f"segment_reduce with reduce={reduce!r} is not supported")


@register_rule(aten.segment_reduce.default)
def _segment_reduce(ctx, data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                    initial=None):
    shape, dtype = builder.shape_of(data), builder.dtype_of(data)
    axis %= len(shape)
    seg = _segments(shape, axis, lengths, offsets)
    combine = _segment_combiner(reduce)
    if seg.count == 0:
        return builder.constant(0, dtype, ctx.aval_out.shape)
    start = _SEGMENT_IDENTITY[reduce] if initial is None else initial
    table_shape = (seg.outer, seg.count + 1, seg.inner)
    values = builder.reshape(data, (seg.outer, seg.span, seg.inner))
    out = _scatter_segments(seg, builder.constant(start, dtype, table_shape), values,
                            lambda current, update: combine(current, update))
    out = builder.slice_static(out, [0, 0, 0], [seg.outer, seg.count, seg.inner], [1, 1, 1])
    if reduce == "mean":
        out_shape = builder.shape_of(out)
        sizes = _segment_sizes(seg, dtype)
        empty = builder.compare(sizes, builder.constant(0, dtype, out_shape), "EQ")
        fallback = out if initial is not None else builder.constant(float("nan"), dtype, out_shape)
        out = builder.select(empty, fallback, hlo.divide(out, sizes))
    return builder.reshape(out, ctx.aval_out.shape)


@register_rule(aten._segment_reduce_backward.default)
def _segment_reduce_backward(ctx, grad, output, data, reduce, *, lengths=None, offsets=None, axis=0,
                             initial=None):
    """The gradient of ``segment_reduce`` as eager computes it: sum and mean spread the segment's gradient,
    max/min give it to every element equal to the result (NaN included), positive gradients split evenly
    among ties; prod divides ``grad * output`` by each element, or multiplies by the product of the others
    for zeros and NaNs."""
    shape, dtype = builder.shape_of(data), builder.dtype_of(data)
    axis %= len(shape)
    seg = _segments(shape, axis, lengths, offsets)
    if seg.count == 0:
        return builder.constant(0, dtype, shape)
    flat_shape = (seg.outer, seg.span, seg.inner)
    table_shape = (seg.outer, seg.count, seg.inner)
    values = builder.reshape(data, flat_shape)
    g = _gather_segments(seg, builder.reshape(grad, table_shape))
    sizes = _gather_segments(seg, _segment_sizes(seg, dtype))
    zero = builder.constant(0, dtype, flat_shape)
    if reduce == "sum":
        result = g
    elif reduce == "mean":
        result = hlo.divide(g, sizes)
    elif reduce in ("max", "min"):
        o = _gather_segments(seg, builder.reshape(output, table_shape))
        tie = hlo.or_(builder.is_nan(values), builder.compare(values, o, "EQ"))
        ties = _per_segment(seg, builder.convert(tie, dtype), hlo.add, 0)
        split = hlo.and_(builder.compare(ties, builder.constant(2, dtype, flat_shape), "GE"),
                         builder.compare(g, zero, "GT"))
        result = builder.select(tie, builder.select(split, hlo.divide(g, ties), g), zero)
    elif reduce == "prod":
        o = _gather_segments(seg, builder.reshape(output, table_shape))
        is_nan = builder.is_nan(values)
        is_zero = builder.compare(values, zero, "EQ")
        special = hlo.or_(is_nan, is_zero)
        one = builder.constant(1, dtype, flat_shape)
        regular = _per_segment(seg, builder.select(special, one, values), hlo.multiply, 1)
        nans = _per_segment(seg, builder.convert(is_nan, dtype), hlo.add, 0)
        zeros = _per_segment(seg, builder.convert(is_zero, dtype), hlo.add, 0)
        other_nans = hlo.subtract(nans, builder.convert(is_nan, dtype))
        other_zeros = hlo.subtract(zeros, builder.convert(is_zero, dtype))
        factor = builder.select(builder.compare(other_zeros, zero, "GT"), zero, one)
        factor = builder.select(builder.compare(other_nans, zero, "GT"), builder.constant(float("nan"), dtype,
                                                                                          flat_shape), factor)
        start = builder.constant(1.0 if initial is None else initial, dtype, flat_shape)
        exclusive = hlo.multiply(hlo.multiply(start, regular), factor)
        result = builder.select(special, hlo.multiply(g, exclusive), hlo.divide(hlo.multiply(g, o), values))
    else:
        raise UnsupportedOpError(f"segment_reduce backward with reduce={reduce!r} is not supported")
    valid = builder.compare(seg.ids, _i64(seg.count, (seg.outer, seg.span)), "LT")
    valid = builder.broadcast_in_dims(valid, flat_shape, [0, 1])
    return builder.reshape(builder.select(valid, result, zero), shape)


def _per_segment(seg: _Segments, values: Value, combine, identity: float) -> Value:
    """Reduce ``values`` (outer, L, inner) per segment and read the result back for each element."""
    dtype = builder.dtype_of(values)
    table = _scatter_segments(seg, builder.constant(identity, dtype, (seg.outer, seg.count + 1, seg.inner)),
                              values, lambda current, update: combine(current, update))
    table = builder.slice_static(table, [0, 0, 0], [seg.outer, seg.count, seg.inner], [1, 1, 1])
    return _gather_segments(seg, table)
