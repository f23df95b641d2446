"""Sorting and selection: ``sort``, ``topk``, ``kthvalue``, ``median``, ``nanmedian``, ``mode``.

All but ``mode`` are one ``stablehlo.sort`` of (values, iota indices) along the dim with a stable comparator, which
gives PyTorch's CPU results: NaN sorts as the largest value (last ascending, first descending), equal values
keep their original order, indices are int64. ``topk`` is a full sort and a slice, or for small ``k``
the same first ``k`` found one reduction at a time; its ties come out lowest index first, where PyTorch's CPU
kernel picks an unspecified order among ties.
``argsort`` never reaches a backend (it is CompositeImplicit: a ``sort`` whose values are dropped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder, dynamic_sizes
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import tensor_type

aten = torch.ops.aten
Value = ir.Value


def _before(a: Value, b: Value, descending: bool) -> Value:
    """Whether scalar ``a`` goes strictly before ``b``: a total order with NaN as the largest value."""
    if descending:
        a, b = b, a
    less = builder.compare(a, b, "LT")
    if builder.dtype_of(a).is_floating_point:
        # a < b, or b is NaN and a is not (NaN is the largest value).
        less = hlo.or_(less, hlo.and_(builder.is_nan(b), hlo.not_(builder.is_nan(a))))
    return less


def sort_along(operands: Sequence[Value], dim: int, descending: bool = False) -> list[Value]:
    """Stable sort of ``operands`` (same shape) along ``dim``, keyed on the first one."""
    op = hlo.SortOp([v.type for v in operands], list(operands), dimension=dim, is_stable=True)
    scalars = [tensor_type((), builder.dtype_of(v)) for v in operands for _ in range(2)]
    block = op.regions[0].blocks.append(*scalars)
    with ir.InsertionPoint(block):
        hlo.return_([_before(block.arguments[0], block.arguments[1], descending)])
    return list(op.results)


def sort_with_indices(x: Value, dim: int, descending: bool = False) -> tuple[Value, Value]:
    """(sorted values, int64 original positions) along ``dim``."""
    indices = builder.iota(builder.shape_of(x), torch.int64, dim)
    values, positions = sort_along([x, indices], dim, descending)
    return values, positions


def _gather_along(x: Value, dim: int, position: Value) -> Value:
    """``x[..., position[...], ...]`` along ``dim`` for a data-dependent ``position`` (x's shape without ``dim``),
    keeping ``dim`` with size 1. Built as a one-hot select and a sum, which needs no gather."""
    shape = builder.shape_of(x)
    dtype = builder.dtype_of(x)
    kept = [1 if d == dim else s for d, s in enumerate(shape)]
    wanted = builder.broadcast_to(builder.reshape(position, kept), shape)
    hit = builder.compare(builder.iota(shape, builder.dtype_of(position), dim), wanted, "EQ")
    if dtype is torch.bool:
        picked = hlo.and_(hit, x)
        init = builder.constant(False, torch.bool, ())
        total = builder.reduce([picked], [init], [dim], lambda acc, el: [hlo.or_(acc[0], el[0])])[0]
    else:
        # select, not multiply, so that inf and NaN elsewhere in the row cannot leak into the result
        zero = builder.constant(0, dtype, shape)
        total = builder.reduce_sum(builder.select(hit, x, zero), [dim])
    return builder.reshape(total, kept)


@register_rule(aten.sort.default)
def _sort(ctx, x, dim=-1, descending=False):
    return _sort_rule(ctx, x, dim, descending)


@register_rule(aten.sort.stable)
def _sort_stable(ctx, x, *, stable=None, dim=-1, descending=False):
    return _sort_rule(ctx, x, dim, descending)


def _last_past_actual(ctx, x: Value, dim: int, descending: bool) -> Value:
    """In a bucketed program where ``dim`` is padded to its bucket, ``x`` as a value of fixed shape with every
    element past the actual size replaced by one that sorts last (NaN or the largest integer ascending; -inf
    or the smallest integer descending). The selection is stable, so actual elements equal to it still come
    first, and ``topk``'s results are of fixed size as torch says (XLA would take the first ``k`` of a padded
    dimension as runtime-sized)."""
    return _padding_last(x, dim, ctx.extent(ctx.operand_metas[0], dim), descending, ctx.fixed_in_place)


def _padding_last(x: Value, dim: int, extent: Value | None, descending: bool, in_place: bool) -> Value:
    """``_last_past_actual`` for a known actual extent of ``dim`` (None: not padded); ``in_place`` as for
    ``dynamic_sizes.fixed_shape``."""
    if extent is None:
        return x
    x = dynamic_sizes.fixed_shape(x, [dim], in_place)
    shape, dtype = builder.shape_of(x), builder.dtype_of(x)
    if descending:
        last = builder.min_value(dtype)
    else:
        last = float("nan") if dtype.is_floating_point else builder.max_value(dtype)
    inside = dynamic_sizes.within_actual(shape, dim, extent)
    return builder.select(inside, x, builder.constant(last, dtype, shape))


def _sort_rule(ctx, x, dim, descending):
    x = builder.at_least_1d(x)
    dim %= builder.rank_of(x)
    # a padded dimension: XLA's dynamic padder sorts the padding last
    values, indices = sort_with_indices(x, dim, descending)
    return builder.reshape(values, ctx.avals_out[0].shape), builder.reshape(indices, ctx.avals_out[1].shape)


TOPK_BY_REDUCTION = 4
"""``topk`` of at most this many elements picks them one reduction at a time (``k`` passes over each row)
instead of sorting the rows: XLA's CPU sort runs its comparator per element pair, which costs more
than ``k`` fused reductions for a small ``k`` (a mixture-of-experts router's top 2)."""


@register_rule(aten.topk.default)
def _topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    x = builder.at_least_1d(x)
    dim %= builder.rank_of(x)
    x = _last_past_actual(ctx, x, dim, descending=largest)
    if 1 <= k <= TOPK_BY_REDUCTION:
        values, indices = _topk_by_reduction(x, dim, k, largest)
    else:
        values, indices = sort_with_indices(x, dim, descending=largest)
        values, indices = builder.slice_along(values, dim, 0, k), builder.slice_along(indices, dim, 0, k)
    return builder.reshape(values, ctx.avals_out[0].shape), builder.reshape(indices, ctx.avals_out[1].shape)


def _topk_by_reduction(x: Value, dim: int, k: int, largest: bool) -> tuple[Value, Value]:
    """The first ``k`` elements along ``dim`` in the order of the stable sort above (NaN as the largest value,
    ties lowest index first), each found by one reduction over the elements not yet taken: the same values
    and indices as the sort's first ``k``."""
    shape = builder.shape_of(x)
    dtype = builder.dtype_of(x)
    positions = builder.iota(shape, torch.int64, dim)
    open_ = builder.constant(True, torch.bool, shape)
    kept = [1 if d == dim else s for d, s in enumerate(shape)]

    def first_of(acc: Sequence[Value], el: Sequence[Value]) -> list[Value]:
        (value_a, index_a, open_a), (value_b, index_b, open_b) = acc, el
        b_first = hlo.or_(
            _before(value_b, value_a, largest),
            hlo.and_(hlo.not_(_before(value_a, value_b, largest)), builder.compare(index_b, index_a, "LT")),
        )
        take_b = hlo.and_(open_b, hlo.or_(hlo.not_(open_a), b_first))
        return [builder.select(take_b, value_b, value_a), builder.select(take_b, index_b, index_a),
                hlo.or_(open_a, open_b)]

    inits = [builder.constant(0, dtype), builder.constant(builder.max_value(torch.int64), torch.int64),
             builder.constant(False, torch.bool)]
    values, indices = [], []
    for _ in range(k):
        value, index, _ = builder.reduce([x, positions, open_], inits, [dim], first_of)
        value, index = builder.reshape(value, kept), builder.reshape(index, kept)
        values.append(value)
        indices.append(index)
        open_ = hlo.and_(open_, builder.compare(positions, builder.broadcast_to(index, shape), "NE"))
    return builder.concatenate(values, dim), builder.concatenate(indices, dim)


def _select_sorted(x, dim, position: int | Value, shapes: Sequence[Sequence[int]]) -> tuple[Value, Value]:
    """Value and original index of the element at sorted ``position`` (static, or per-row data) along
    ``dim``, reshaped to ``shapes``."""
    x = builder.at_least_1d(x)
    dim %= builder.rank_of(x)
    values, indices = sort_with_indices(x, dim)
    if isinstance(position, int):
        value, index = (builder.slice_along(values, dim, position, position + 1),
                        builder.slice_along(indices, dim, position, position + 1))
    else:
        value, index = _gather_along(values, dim, position), _gather_along(indices, dim, position)
    return builder.reshape(value, shapes[0]), builder.reshape(index, shapes[1])


def _out_shapes(ctx) -> list[tuple[int, ...]]:
    return [spec.shape for spec in ctx.avals_out]


@register_rule(aten.kthvalue.default)
def _kthvalue(ctx, x, k, dim=-1, keepdim=False):
    x = builder.at_least_1d(x)
    dim %= builder.rank_of(x)
    return _select_sorted(_last_past_actual(ctx, x, dim, descending=False), dim, k - 1, _out_shapes(ctx))


def _actual_row(x: Value, dim: int, extent: Value | None, in_place: bool) -> tuple[Value, Value, Value]:
    """(x, its row length, its NaN count) along ``dim`` (length and count int64, ``dim`` removed). Where a
    bucket pads ``dim`` (``extent``, its actual size), the padding is made NaN (or the largest integer):
    stable sorting puts it after every actual element, actual NaNs included, and neither figure counts it."""
    shape = builder.shape_of(x)
    rows = [s for d, s in enumerate(shape) if d != dim]
    if extent is None:
        return x, builder.constant(shape[dim], torch.int64, rows), _nan_count(x, dim)
    padded = _padding_last(x, dim, extent, descending=False, in_place=in_place)
    length = builder.broadcast_to(builder.convert(extent, torch.int64), rows)
    if not builder.dtype_of(x).is_floating_point:
        return padded, length, builder.constant(0, torch.int64, rows)
    inside = dynamic_sizes.within_actual(builder.shape_of(padded), dim, extent)
    nans = builder.reduce_sum(builder.convert(hlo.and_(inside, builder.is_nan(padded)), torch.int64), [dim])
    return padded, length, nans


def _nan_count(x: Value, dim: int) -> Value:
    """int64 number of NaNs along ``dim`` (zeros for non-float dtypes), with ``dim`` removed."""
    shape = builder.shape_of(x)
    if not builder.dtype_of(x).is_floating_point:
        return builder.constant(0, torch.int64, [s for d, s in enumerate(shape) if d != dim])
    return builder.reduce_sum(builder.convert(builder.is_nan(x), torch.int64), [dim])


def _median(x: Value, dim: int, shapes: Sequence[Sequence[int]], extent: Value | None = None,
            in_place: bool = False) -> tuple[Value, Value]:
    """The lower median; any NaN in the row makes the result that NaN (the first one: sorting is stable).
    ``extent``: the actual size of a padded ``dim``."""
    x = builder.at_least_1d(x)
    dim %= builder.rank_of(x)
    x, size, nans = _actual_row(x, dim, extent, in_place)
    shape = builder.shape_of(nans)
    one = builder.constant(1, torch.int64, shape)
    middle = hlo.divide(hlo.subtract(size, one), builder.constant(2, torch.int64, shape))
    first_nan = hlo.subtract(size, nans)
    has_nan = builder.compare(nans, builder.constant(0, torch.int64, shape), "GT")
    return _select_sorted(x, dim, builder.select(has_nan, first_nan, middle), shapes)


def _nanmedian(x: Value, dim: int, shapes: Sequence[Sequence[int]], extent: Value | None = None,
               in_place: bool = False) -> tuple[Value, Value]:
    """The lower median of the non-NaN values (NaN only for an all-NaN row): NaNs sort last, so it sits at
    ``(count - 1) // 2`` of the sorted row. ``extent``: the actual size of a padded ``dim``."""
    x = builder.at_least_1d(x)
    dim %= builder.rank_of(x)
    x, size, nans = _actual_row(x, dim, extent, in_place)
    shape = builder.shape_of(nans)
    count = hlo.subtract(size, nans)
    half = hlo.divide(
        hlo.subtract(count, builder.constant(1, torch.int64, shape)), builder.constant(2, torch.int64, shape)
    )
    position = hlo.maximum(half, builder.constant(0, torch.int64, shape))
    return _select_sorted(x, dim, position, shapes)


def _flat(x: Value) -> Value:
    return builder.reshape(x, (max(1, math.prod(builder.shape_of(x))),))


@register_rule(aten.median.dim)
def _median_dim(ctx, x, dim, keepdim=False):
    return _median(x, dim, _out_shapes(ctx), ctx.extent(ctx.operand_metas[0], dim), ctx.fixed_in_place)


@register_rule(aten.median.default)
def _median_all(ctx, x):
    return _median(_flat(x), 0, [(), ()])[0]


@register_rule(aten.nanmedian.dim)
def _nanmedian_dim(ctx, x, dim, keepdim=False):
    return _nanmedian(x, dim, _out_shapes(ctx), ctx.extent(ctx.operand_metas[0], dim), ctx.fixed_in_place)


@register_rule(aten.nanmedian.default)
def _nanmedian_all(ctx, x):
    return _nanmedian(_flat(x), 0, [(), ()])[0]


@register_rule(aten.mode.default)
def _mode(ctx, x, dim=-1, keepdim=False):
    """The most frequent value along ``dim`` (the smallest among equally frequent ones) and the last index
    where it occurs, as PyTorch's CPU kernel gives. Counting is an n-by-n comparison per row, fine for the row
    lengths ``mode`` is used with."""
    x = builder.at_least_1d(x)
    rank = builder.rank_of(x)
    dim %= rank
    x = builder.transpose(x, [d for d in range(rank) if d != dim] + [dim])  # the counted dim last
    shape = builder.shape_of(x)
    n = shape[-1]
    pairs = (*shape, n)
    mine = builder.broadcast_in_dims(x, pairs, list(range(rank)))
    theirs = builder.broadcast_in_dims(x, pairs, [*range(rank - 1), rank])
    equal = builder.convert(builder.compare(mine, theirs, "EQ"), torch.int64)  # NaN equals nothing
    counts = builder.reduce_sum(equal, [rank])
    indices = builder.iota(shape, torch.int64, rank - 1)
    dtype = builder.dtype_of(x)

    def better(acc, el):
        (ca, va, ia), (cb, vb, ib) = acc, el
        more = builder.compare(ca, cb, "GT")
        same_count = builder.compare(ca, cb, "EQ")
        smaller = _before(va, vb, False)
        same_value = hlo.not_(hlo.or_(_before(va, vb, False), _before(vb, va, False)))
        later = builder.compare(ia, ib, "GT")
        pick_a = hlo.or_(more, hlo.and_(same_count, hlo.or_(smaller, hlo.and_(same_value, later))))
        return [builder.select(pick_a, a, b) for a, b in ((ca, cb), (va, vb), (ia, ib))]

    inits = [
        builder.constant(-1, torch.int64, ()),
        builder.constant(builder.max_value(dtype), dtype, ()),
        builder.constant(-1, torch.int64, ()),
    ]
    _, value, index = builder.reduce([counts, x, indices], inits, [rank - 1], better)
    return builder.reshape(value, ctx.avals_out[0].shape), builder.reshape(index, ctx.avals_out[1].shape)
