"""``torch.nn.functional.embedding_bag``: ``_embedding_bag`` / ``_embedding_bag_forward_only`` and their
backward ops, on static shapes.

Offsets are data, so bag membership is computed, not sliced: a 1 is scattered at each bag start after the
first, and a prefix sum turns that into the bag id of every index position (bag id = number of offsets
``<=`` the position, minus one). Bags are then reduced with scatters over those ids: a sum, a count (for
``mean``; empty bags give 0), or a max (empty bags give 0; the index reported for a max is that of the
first position reaching it, as PyTorch's CPU kernel does). Positions holding ``padding_idx`` take no part.
With ``include_last_offset`` the last offset only closes the list: the last bag runs to the end of
``indices``, as in PyTorch.

The three auxiliary results (``offset2bag``, ``bag_size``, ``max_indices``) only feed the backward; their
shapes follow the traced graph, and their values PyTorch's where the backward reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten
Value = ir.Value

SUM, MEAN, MAX = 0, 1, 2


def _rows(table: Value, indices: Value) -> Value:
    """``table[indices]`` for a 1-d index vector: shape ``[len(indices), *table.shape[1:]]``."""
    shape = builder.shape_of(table)
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=list(range(1, len(shape))),
        collapsed_slice_dims=[0],
        operand_batching_dims=[],
        start_indices_batching_dims=[],
        start_index_map=[0],
        index_vector_dim=1,
    )
    return hlo.gather(table, indices, numbers, [1, *shape[1:]])


def _column(vector: Value, width: int) -> Value:
    """A length-n vector stretched to ``[n, width]`` (one value per row)."""
    return builder.broadcast_in_dims(vector, (builder.shape_of(vector)[0], width), [0])


def bag_ids(offsets: Value, count: int) -> Value:
    """The bag (int64) of each of ``count`` index positions: the number of ``offsets[1:]`` at or before it.

    Every offset after the first opens a bag, and with ``include_last_offset`` the last one closes the last
    bag, so positions from there on get the id ``num_bags`` and are masked out by ``_valid``. An offset equal
    to ``count`` is dropped by the scatter.
    """
    offsets = builder.convert(offsets, torch.int64)
    total = builder.shape_of(offsets)[0]
    starts = builder.slice_static(offsets, [min(1, total)], [total], [1])
    starts = builder.reshape(starts, (builder.shape_of(starts)[0], 1))
    ones = builder.constant(1, torch.int64, (builder.shape_of(starts)[0],))
    marks = builder.constant(0, torch.int64, (count,))
    marks = builder.scatter_rows(marks, starts, ones, hlo.add)
    zero = builder.constant(0, torch.int64, ())
    return builder.scan([marks], [zero], 0, lambda acc, el: [hlo.add(acc[0], el[0])])[0]


def _valid(indices: Value, bags: Value, num_bags: int, padding_idx: int) -> Value:
    """Positions that take part: inside a bag (not past a closing last offset) and not ``padding_idx``."""
    shape = builder.shape_of(indices)
    valid = builder.compare(bags, builder.constant(num_bags, torch.int64, shape), "LT")
    if padding_idx >= 0:
        padding = builder.constant(padding_idx, builder.dtype_of(indices), shape)
        valid = hlo.and_(valid, builder.compare(indices, padding, "NE"))
    return valid


def _bag_sizes(bags: Value, valid: Value, num_bags: int) -> Value:
    count = builder.shape_of(bags)[0]
    ones = builder.convert(valid, torch.int64)
    sizes = builder.constant(0, torch.int64, (num_bags,))
    return builder.scatter_rows(sizes, builder.reshape(bags, (count, 1)), ones, hlo.add)


def _fit(value: Value, shape: Sequence[int], dtype: torch.dtype) -> Value:
    """``value`` converted and cut or zero-padded along dim 0 to ``shape`` (the traced aux result)."""
    value = builder.convert(value, dtype)
    have = builder.shape_of(value)
    shape = tuple(shape)
    if have == shape:
        return value
    if len(have) != len(shape) or have[1:] != shape[1:] or shape[0] == 0:
        return builder.constant(0, dtype, shape)
    if shape[0] < have[0]:
        return builder.slice_static(value, [0] * len(shape), list(shape), [1] * len(shape))
    zero = builder.constant(0, dtype, ())
    return hlo.pad(value, zero, [0] * len(shape), [shape[0] - have[0]] + [0] * (len(shape) - 1), [0] * len(shape))


def _forward(ctx, weight, indices, offsets, scale_grad_by_freq=False, mode=SUM, sparse=False,
             per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    out_spec, bag_spec, size_spec, max_spec = ctx.avals_out
    num_bags, width = out_spec.shape
    count = builder.shape_of(indices)[0]
    dtype = builder.dtype_of(weight)
    compute = builder.accumulator_dtype(dtype)
    index_dtype = builder.dtype_of(indices)
    if per_sample_weights is not None and mode != SUM:
        raise UnsupportedOpError("embedding_bag: per_sample_weights are only supported with mode='sum'")

    bags = bag_ids(offsets, count)
    valid = _valid(indices, bags, num_bags, padding_idx)
    sizes = _bag_sizes(bags, valid, num_bags)
    rows = builder.convert(_rows(weight, indices), compute)
    bag_rows = builder.reshape(bags, (count, 1))
    keep = _column(valid, width)

    if mode in (SUM, MEAN):
        contributions = rows
        if per_sample_weights is not None:
            contributions = hlo.multiply(rows, _column(builder.convert(per_sample_weights, compute), width))
        contributions = builder.select(keep, contributions, builder.constant(0, compute, (count, width)))
        total = builder.scatter_rows(builder.constant(0, compute, (num_bags, width)), bag_rows, contributions, hlo.add)
        if mode == MEAN:
            divisor = hlo.maximum(sizes, builder.constant(1, torch.int64, (num_bags,)))
            total = hlo.divide(total, _column(builder.convert(divisor, compute), width))
        output = builder.convert(total, dtype)
        extra = sizes if mode == MEAN else builder.constant(0, torch.int64, (num_bags,))
        size_out = sizes if mode == MEAN else builder.constant(0, torch.int64, (num_bags,))
    elif mode == MAX:
        lowest = builder.constant(float("-inf") if compute.is_floating_point else builder.min_value(compute),
                                  compute, (count, width))
        candidates = builder.select(keep, rows, lowest)
        start = builder.constant(builder.min_value(compute), compute, (num_bags, width))
        best = builder.scatter_rows(start, bag_rows, candidates, hlo.maximum)
        # The first position whose value reaches its bag's max gives the reported weight row.
        reached = hlo.and_(builder.compare(candidates, _rows(best, bags), "EQ"), keep)
        positions = builder.iota((count, width), torch.int64, 0)
        never = builder.constant(count, torch.int64, (count, width))
        first = builder.scatter_rows(builder.constant(count, torch.int64, (num_bags, width)), bag_rows,
                                     builder.select(reached, positions, never), hlo.minimum)
        nonempty = _column(builder.compare(sizes, builder.constant(0, torch.int64, (num_bags,)), "GT"), width)
        found = builder.compare(first, builder.constant(count, torch.int64, (num_bags, width)), "LT")
        safe = builder.select(found, first, builder.constant(0, torch.int64, (num_bags, width)))
        flat = builder.reshape(safe, (num_bags * width,))
        chosen = builder.reshape(builder.convert(_rows(indices, flat), torch.int64), (num_bags, width))
        extra = builder.select(hlo.and_(nonempty, found), chosen, builder.constant(0, torch.int64, (num_bags, width)))
        zero = builder.constant(0, dtype, (num_bags, width))
        output = builder.select(nonempty, builder.convert(best, dtype), zero)
        size_out = sizes
    else:
        raise UnsupportedOpError(f"embedding_bag: unknown mode {mode}")

    return (
        output,
        _fit(bags, bag_spec.shape, index_dtype),
        _fit(size_out, size_spec.shape, index_dtype),
        _fit(extra, max_spec.shape, index_dtype),
    )


@register_rule(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(ctx, weight, indices, offsets, *args, **kwargs):
    return _forward(ctx, weight, indices, offsets, *args, **kwargs)


def _frequency_scale(indices: Value, num_weights: int, dtype: torch.dtype) -> Value:
    """``1 / (how often indices[i] occurs in indices)`` per position (``scale_grad_by_freq``)."""
    count = builder.shape_of(indices)[0]
    rows = builder.reshape(indices, (count, 1))
    counts = builder.scatter_rows(builder.constant(0, torch.int64, (num_weights,)), rows,
                                  builder.constant(1, torch.int64, (count,)), hlo.add)
    mine = builder.convert(_rows(counts, indices), dtype)
    return hlo.divide(builder.constant(1, dtype, (count,)), mine)


def _backward(grad, indices, bags, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
              per_sample_weights, padding_idx) -> Value:
    num_bags, width = builder.shape_of(grad)
    count = builder.shape_of(indices)[0]
    dtype = builder.dtype_of(grad)
    compute = builder.accumulator_dtype(dtype)
    grad = builder.convert(grad, compute)
    result = builder.constant(0, compute, (num_weights, width))
    if mode == MAX:
        sizes = builder.convert(bag_size, torch.int64)
        nonempty = _column(builder.compare(sizes, builder.constant(0, torch.int64, (num_bags,)), "GT"), width)
        updates = builder.select(nonempty, grad, builder.constant(0, compute, (num_bags, width)))
        rows = builder.reshape(builder.convert(maximum_indices, torch.int64), (num_bags, width, 1))
        cols = builder.reshape(builder.iota((num_bags, width), torch.int64, 1), (num_bags, width, 1))
        numbers = hlo.ScatterDimensionNumbers.get(
            update_window_dims=[],
            inserted_window_dims=[0, 1],
            input_batching_dims=[],
            scatter_indices_batching_dims=[],
            scattered_dims_to_operand_dims=[0, 1],
            index_vector_dim=2,
        )
        result = builder.scatter(result, builder.concatenate([rows, cols], 2), updates, numbers, hlo.add)
        return builder.convert(result, dtype)
    valid = _valid(indices, bags, num_bags, padding_idx)
    per_position = _rows(grad, bags)  # [count, width]; rows of masked positions are dropped below
    scale = None
    if mode == MEAN:
        sizes = _bag_sizes(bags, valid, num_bags)
        divisor = hlo.maximum(sizes, builder.constant(1, torch.int64, (num_bags,)))
        scale = hlo.divide(builder.constant(1, compute, (count,)), builder.convert(_rows(divisor, bags), compute))
    if per_sample_weights is not None:
        weights = builder.convert(per_sample_weights, compute)
        scale = weights if scale is None else hlo.multiply(scale, weights)
    if scale_grad_by_freq:
        frequency = _frequency_scale(indices, num_weights, compute)
        scale = frequency if scale is None else hlo.multiply(scale, frequency)
    if scale is not None:
        per_position = hlo.multiply(per_position, _column(scale, width))
    per_position = builder.select(_column(valid, width), per_position, builder.constant(0, compute, (count, width)))
    result = builder.scatter_rows(result, builder.reshape(indices, (count, 1)), per_position, hlo.add)
    return builder.convert(result, dtype)


@register_rule(aten._embedding_bag_backward.default)
def _embedding_bag_backward(ctx, grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                            scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    if sparse:
        raise UnsupportedOpError("embedding_bag with sparse=True gives sparse gradients, which tpucompile cannot")
    bags = bag_ids(offsets, builder.shape_of(indices)[0])
    return _backward(grad, indices, bags, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
                     per_sample_weights, padding_idx)


@register_rule(aten._embedding_bag_dense_backward.default)
def _embedding_bag_dense_backward(ctx, grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                  scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    count = builder.shape_of(indices)[0]
    if mode != MAX and builder.shape_of(offset2bag) != (count,):
        raise UnsupportedOpError(
            "_embedding_bag_dense_backward without offset2bag (mode='sum' without padding_idx) needs the offsets"
        )
    bags = builder.convert(offset2bag, torch.int64) if mode != MAX else None
    return _backward(grad, indices, bags, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
                     per_sample_weights, padding_idx)


@register_rule(aten._embedding_bag_per_sample_weights_backward.default)
def _per_sample_weights_backward(ctx, grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    if mode != SUM:
        raise UnsupportedOpError("embedding_bag: per_sample_weights are only supported with mode='sum'")
    num_bags = builder.shape_of(grad)[0]
    count = builder.shape_of(indices)[0]
    compute = builder.accumulator_dtype(builder.dtype_of(grad))
    bags = bag_ids(offsets, count)
    per_position = builder.convert(_rows(grad, bags), compute)
    products = hlo.multiply(per_position, builder.convert(_rows(weight, indices), compute))
    result = builder.reduce_sum(products, [1])
    valid = _valid(indices, bags, num_bags, padding_idx)
    result = builder.select(valid, result, builder.constant(0, compute, (count,)))
    return builder.convert(result, ctx.aval_out.dtype)
