"""Pooling: max (with PyTorch's indices), average and adaptive pooling over 1 to 3 spatial dims, and backward.

After AOTAutograd's decomposition table, 1d pooling arrives as the 2d op on an unsqueezed input, and these ops
reach the backend: ``max_pool{2,3}d_with_indices`` (+ backward), ``avg_pool{2,3}d`` (+ backward),
``_adaptive_avg_pool{2,3}d`` (+ backward), ``adaptive_max_pool{2,3}d`` (+ backward). The pooled dims are
always the trailing ones; every dim before them (batch, channels, or channels alone) is a batch dim.

* Max pooling folds (value, flat index) pairs with a combiner that reproduces PyTorch's CPU kernel, which
  scans a window in order and keeps an element if ``val > max || isnan(val)``: the larger value wins, ties
  go to the first index, NaN beats any number and among NaNs the last one wins. Small windows fold one
  strided slice per window offset (elementwise, fused by XLA); larger ones are a two-result
  ``reduce_window``. Indices are flat into the input's pooled plane (``h * W + w``); the backward scatters
  the gradient to them.
* Average pooling sums with ``reduce_window`` and divides by a per-window count computed statically, which
  follows PyTorch's ``count_include_pad`` / ``divisor_override`` / ``ceil_mode`` rules. The backward is a
  ``reduce_window`` sum over the stride-dilated ``grad / count``.
* Adaptive pooling windows (``[floor(o X / O), ceil((o + 1) X / O))``) are regular when X is a multiple of
  O, and then use the fixed-window lowering. Otherwise average pooling contracts each pooled dim with a 0/1
  window matrix (separable), and max pooling gathers each window, padded by repeating its last element, and
  reduces it.

Low-precision floats accumulate sums in f32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import tensor_type

aten = torch.ops.aten
Value = ir.Value

_NO_INDEX = torch.iinfo(torch.int64).max
"""The index of padding in max pooling: it never wins a tie against a real element."""


def _high_padding(size: int, window: int, stride: int, low: int, out: int) -> int:
    """The high padding that makes a window of (dilated) size ``window`` produce exactly ``out`` positions.

    Never negative: when the formula would crop, padding 0 already yields ``out`` windows (the cropped part
    is shorter than a stride) — and reduce_window's padding must be non-negative."""
    return max(0, (out - 1) * stride + window - size - low)


# --- max pooling ------------------------------------------------------------------------------------------


def _argmax_combiner(dtype: torch.dtype) -> Callable[[Sequence[Value], Sequence[Value]], list[Value]]:
    """(value, index) pairs → the pair PyTorch's CPU kernel keeps (see the module docstring)."""

    def combine(a: Sequence[Value], b: Sequence[Value]) -> list[Value]:
        (a_val, a_idx), (b_val, b_idx) = a, b
        earlier = builder.compare(b_idx, a_idx, "LT")
        greater, equal = builder.compare(b_val, a_val, "GT"), builder.compare(b_val, a_val, "EQ")
        take_b = hlo.or_(greater, hlo.and_(equal, earlier))
        if dtype.is_floating_point:
            a_nan, b_nan = builder.is_nan(a_val), builder.is_nan(b_val)
            later = builder.compare(b_idx, a_idx, "GT")
            nan_wins = hlo.and_(b_nan, hlo.or_(hlo.not_(a_nan), later))
            take_b = hlo.or_(nan_wins, hlo.and_(take_b, hlo.not_(a_nan)))
        return [builder.select(take_b, b_val, a_val), builder.select(take_b, b_idx, a_idx)]

    return combine


def _argmax_inits(dtype: torch.dtype) -> list[Value]:
    return [builder.constant(builder.min_value(dtype), dtype), builder.constant(_NO_INDEX, torch.int64)]


def _flat_indices(shape: Sequence[int], nd: int) -> Value:
    """int64 tensor of ``shape`` holding each element's flat index in its trailing ``nd``-dim plane."""
    plane = tuple(shape[-nd:])
    flat = builder.iota((math.prod(plane),), torch.int64, 0)
    return builder.broadcast_in_dims(builder.reshape(flat, plane), shape, range(len(shape) - nd, len(shape)))


def _argmax_window(
    x: Value,
    out_shape: Sequence[int],
    window: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    dilations: Sequence[int],
) -> list[Value]:
    """Max pooling of the trailing dims of ``x`` with PyTorch's indices: ``[values, int64 indices]``."""
    dtype = builder.dtype_of(x)
    shape = builder.shape_of(x)
    lead = len(shape) - len(window)
    op = hlo.ReduceWindowOp(
        [tensor_type(tuple(out_shape), dtype), tensor_type(tuple(out_shape), torch.int64)],
        [x, _flat_indices(shape, len(window))],
        _argmax_inits(dtype),
        [1] * lead + list(window),
        window_strides=[1] * lead + list(strides),
        window_dilations=[1] * lead + list(dilations),
        padding=ir.DenseIntElementsAttr.get(
            np.asarray([(0, 0)] * lead + list(padding), dtype=np.int64).reshape(len(shape), 2)
        ),
    )
    builder.fill_combiner(op, [tensor_type((), dtype), tensor_type((), torch.int64)], _argmax_combiner(dtype))
    return list(op.results)


_UNROLLED_WINDOW_LIMIT = 32
"""Windows of at most this many elements are pooled by ``_argmax_unrolled``."""


def _argmax_unrolled(
    x: Value,
    out_shape: Sequence[int],
    window: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    dilations: Sequence[int],
) -> list[Value]:
    """``_argmax_window`` from one strided slice per window offset, in two elementwise passes.

    Only elementwise ops: XLA fuses them into loops, where its CPU backend runs a two-result ``reduce_window``
    element by element. The values are a chain of ``maximum`` (which
    propagates NaN, as PyTorch's kernel does); the index is then the first real element in scan order equal to
    the maximum, or, where the maximum is NaN, the last NaN: a chain of selects visited backwards (so the
    first match in scan order is written last). XLA splits values and indices into separate loops, so each
    stays short; a fold carrying (value, index) pairs through PyTorch's combiner costs both loops its whole
    chain. Nothing computes indices when nothing reads them."""
    dtype = builder.dtype_of(x)
    shape = builder.shape_of(x)
    nd = len(window)
    lead = len(shape) - nd
    plane_in, plane_out = shape[lead:], tuple(out_shape[lead:])
    fill = builder.constant(builder.min_value(dtype), dtype)
    padded = hlo.pad(x, fill, [0] * lead + [low for low, _ in padding], [0] * lead + [high for _, high in padding],
                     [0] * len(shape))
    plane_strides = [math.prod(plane_in[i + 1:]) for i in range(nd)]
    taps: list[tuple[Value, Value, Value]] = []  # (values, flat index plane, inside plane) per window offset
    for offset in np.ndindex(*window):
        starts = [o * d for o, d in zip(offset, dilations, strict=True)]
        limits = [start + (out - 1) * s + 1 for start, out, s in zip(starts, plane_out, strides, strict=True)]
        values = builder.slice_static(padded, [0] * lead + starts, list(shape[:lead]) + limits,
                                      [1] * lead + list(strides))
        flat, valid = None, None
        for i in range(nd):
            position = builder.iota(plane_out, torch.int64, i)
            position = hlo.add(hlo.multiply(position, builder.constant(strides[i], torch.int64, plane_out)),
                               builder.constant(starts[i] - padding[i][0], torch.int64, plane_out))
            inside = hlo.and_(builder.compare(position, builder.constant(0, torch.int64, plane_out), "GE"),
                              builder.compare(position, builder.constant(plane_in[i], torch.int64, plane_out), "LT"))
            term = hlo.multiply(position, builder.constant(plane_strides[i], torch.int64, plane_out))
            flat = term if flat is None else hlo.add(flat, term)
            valid = inside if valid is None else hlo.and_(valid, inside)
        taps.append((values, flat, valid))
    best = taps[0][0]
    for values, _, _ in taps[1:]:
        best = hlo.maximum(best, values)
    out = tuple(out_shape)

    def spread(plane: Value) -> Value:
        return builder.broadcast_in_dims(plane, out, range(lead, len(shape)))

    index = builder.constant(_NO_INDEX, torch.int64, out)
    for values, flat, valid in reversed(taps):
        index = builder.select(hlo.and_(builder.compare(values, best, "EQ"), spread(valid)), spread(flat), index)
    if dtype.is_floating_point:
        last_nan = builder.constant(_NO_INDEX, torch.int64, out)
        for values, flat, _ in taps:
            last_nan = builder.select(builder.is_nan(values), spread(flat), last_nan)
        index = builder.select(builder.is_nan(best), last_nan, index)
    return [best, index]


def _max_pool(x, out_shape, kernel, stride, padding, dilation):
    shape = builder.shape_of(x)
    nd = len(kernel)
    pads = []
    for size, k, s, p, d, out in zip(shape[-nd:], kernel, stride, padding, dilation, out_shape[-nd:], strict=True):
        pads.append((p, _high_padding(size, d * (k - 1) + 1, s, p, out)))
    if math.prod(kernel) <= _UNROLLED_WINDOW_LIMIT and 0 not in out_shape and 0 not in shape:
        return _argmax_unrolled(x, out_shape, kernel, stride, pads, dilation)
    return _argmax_window(x, out_shape, kernel, stride, pads, dilation)


@register_rule(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def _max_pool_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    nd = 2 if ctx.node.target is aten.max_pool2d_with_indices.default else 3
    kernel = builder.per_dim(kernel_size, nd)
    stride, padding, dilation = (builder.per_dim(stride, nd, kernel), builder.per_dim(padding, nd),
                                 builder.per_dim(dilation, nd))
    return _max_pool(x, ctx.aval_out.shape, kernel, stride, padding, dilation)


def _scatter_to_indices(ctx, grad: Value, indices: Value, nd: int) -> Value:
    """The gradient of a max: add each ``grad`` element to the input element its flat ``index`` names."""
    in_spec = ctx.aval_out
    in_shape, dtype = in_spec.shape, in_spec.dtype
    acc = builder.accumulator_dtype(dtype)
    lead = math.prod(in_shape[:-nd])
    plane = math.prod(in_shape[-nd:])
    count = math.prod(builder.shape_of(grad)[-nd:])
    grad = builder.reshape(builder.convert(grad, acc), (lead, count))
    flat = builder.reshape(builder.convert(indices, torch.int64), (lead, count, 1))
    rows = builder.iota((lead, count, 1), torch.int64, 0)
    numbers = hlo.ScatterDimensionNumbers.get(
        update_window_dims=[],
        inserted_window_dims=[0, 1],
        input_batching_dims=[],
        scatter_indices_batching_dims=[],
        scattered_dims_to_operand_dims=[0, 1],
        index_vector_dim=2,
    )
    zeros = builder.constant(0, acc, (lead, plane))
    result = builder.scatter(zeros, builder.concatenate([rows, flat], 2), grad, numbers, hlo.add)
    return builder.convert(builder.reshape(result, in_shape), dtype)


@register_rule(aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default)
def _max_pool_with_indices_backward(ctx, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    nd = 2 if ctx.node.target is aten.max_pool2d_with_indices_backward.default else 3
    return _scatter_to_indices(ctx, grad, indices, nd)


# --- average pooling --------------------------------------------------------------------------------------


def _window_sizes(size: int, out: int, k: int, s: int, p: int, include_pad: bool) -> np.ndarray:
    """How many elements PyTorch's average pooling divides by along one dim, for each output position."""
    counts = np.empty(out, dtype=np.int64)
    for o in range(out):
        start = o * s - p
        end = min(start + k, size + p)
        counts[o] = end - start if include_pad else min(end, size) - max(start, 0)
    return counts


def _divisors(out_shape, in_shape, kernel, stride, padding, include_pad, divisor_override, dtype) -> Value:
    """The per-window divisor, broadcast to ``out_shape``, in ``dtype``."""
    if divisor_override:
        return builder.constant(divisor_override, dtype, out_shape)
    nd = len(kernel)
    total = np.ones((), dtype=np.int64)
    for size, out, k, s, p in zip(in_shape[-nd:], out_shape[-nd:], kernel, stride, padding, strict=True):
        total = np.multiply.outer(total, _window_sizes(size, out, k, s, p, include_pad))
    counts = builder.dense_constant(torch.from_numpy(total).to(dtype))
    return builder.broadcast_in_dims(counts, out_shape, range(len(out_shape) - nd, len(out_shape)))


def _window_sum(x: Value, kernel, stride, padding, out_shape, base_dilation=None) -> Value:
    """Sum of each window of the trailing dims of ``x``; ``padding`` per pooled dim, high side may be None."""
    shape = builder.shape_of(x)
    nd = len(kernel)
    lead = len(shape) - nd
    dilation = base_dilation or [1] * nd
    pads = []
    for size, out, k, s, (lo, hi), bd in zip(shape[-nd:], out_shape[-nd:], kernel, stride, padding, dilation,
                                              strict=True):
        pads.append((lo, hi if hi is not None else _high_padding((size - 1) * bd + 1, k, s, lo, out)))
    dtype = builder.dtype_of(x)
    return builder.reduce_window(
        x,
        builder.constant(0, dtype),
        [1] * lead + list(kernel),
        [1] * lead + list(stride),
        [(0, 0)] * lead + pads,
        hlo.add,
        base_dilations=[1] * lead + list(dilation),
    )


def _avg_pool(x, out_shape, out_dtype, kernel, stride, padding, include_pad, divisor_override) -> Value:
    acc = builder.accumulator_dtype(out_dtype)
    x = builder.convert(x, acc)
    total = _window_sum(x, kernel, stride, [(p, None) for p in padding], out_shape)
    divisor = _divisors(out_shape, builder.shape_of(x), kernel, stride, padding, include_pad, divisor_override, acc)
    return builder.convert(hlo.divide(total, divisor), out_dtype)


def _avg_pool_backward(grad, in_shape, in_dtype, kernel, stride, padding, include_pad, divisor_override) -> Value:
    """Each input element receives ``grad / divisor`` of every window that covers it: a window sum over the
    gradient dilated by the stride (window o covers padded positions ``[o s, o s + k)``)."""
    acc = builder.accumulator_dtype(in_dtype)
    grad = builder.convert(grad, acc)
    out_shape = builder.shape_of(grad)
    grad = hlo.divide(grad, _divisors(out_shape, in_shape, kernel, stride, padding, include_pad, divisor_override,
                                      acc))
    nd = len(kernel)
    pads = []
    for size, out, k, s, p in zip(in_shape[-nd:], out_shape[-nd:], kernel, stride, padding, strict=True):
        lo = k - 1 - p
        pads.append((lo, size + k - 1 - lo - ((out - 1) * s + 1)))
    result = _window_sum(grad, kernel, [1] * nd, pads, in_shape, base_dilation=stride)
    return builder.convert(result, in_dtype)


def _avg_nd(target) -> int:
    return 2 if target in (aten.avg_pool2d.default, aten.avg_pool2d_backward.default) else 3


@register_rule(aten.avg_pool2d.default, aten.avg_pool3d.default)
def _avg_pool_rule(
    ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
):
    nd = _avg_nd(ctx.node.target)
    kernel = builder.per_dim(kernel_size, nd)
    stride, padding = builder.per_dim(stride, nd, kernel), builder.per_dim(padding, nd)
    return _avg_pool(
        x, ctx.aval_out.shape, ctx.aval_out.dtype, kernel, stride, padding, count_include_pad, divisor_override
    )


@register_rule(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def _avg_pool_backward_rule(
    ctx, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    nd = _avg_nd(ctx.node.target)
    kernel = builder.per_dim(kernel_size, nd)
    stride, padding = builder.per_dim(stride, nd, kernel), builder.per_dim(padding, nd)
    return _avg_pool_backward(
        grad, ctx.aval_out.shape, ctx.aval_out.dtype, kernel, stride, padding, count_include_pad, divisor_override
    )


# --- adaptive pooling -------------------------------------------------------------------------------------


def _adaptive_windows(size: int, out: int) -> list[tuple[int, int]]:
    """PyTorch's adaptive windows along one dim: ``[floor(o size / out), ceil((o + 1) size / out))``."""
    return [((o * size) // out, -((-(o + 1) * size) // out)) for o in range(out)]


def _regular_kernel(in_shape: Sequence[int], out_shape: Sequence[int], nd: int) -> list[int] | None:
    """The fixed window of an adaptive pooling whose windows happen to be regular (size a multiple of out)."""
    pairs = list(zip(in_shape[-nd:], out_shape[-nd:], strict=True))
    if all(out > 0 and size % out == 0 for size, out in pairs):
        return [size // out for size, out in pairs]
    return None


def _window_matrix(size: int, out: int) -> np.ndarray:
    """``(out, size)`` 0/1 matrix: row o marks the elements of adaptive window o."""
    matrix = np.zeros((out, size), dtype=np.float32)
    for o, (start, end) in enumerate(_adaptive_windows(size, out)):
        matrix[o, start:end] = 1
    return matrix


def _adaptive_counts(in_shape, out_shape, nd: int, dtype: torch.dtype) -> Value:
    total = np.ones((), dtype=np.int64)
    for size, out in zip(in_shape[-nd:], out_shape[-nd:], strict=True):
        total = np.multiply.outer(total, np.asarray([e - s for s, e in _adaptive_windows(size, out)], np.int64))
    counts = builder.dense_constant(torch.from_numpy(total).to(dtype))
    return builder.broadcast_in_dims(counts, out_shape, range(len(out_shape) - nd, len(out_shape)))


def _adaptive_nd(target) -> int:
    two = (aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default,
           aten.adaptive_max_pool2d.default, aten.adaptive_max_pool2d_backward.default)
    return 2 if target in two else 3


@register_rule(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool(ctx, x, output_size):
    nd = _adaptive_nd(ctx.node.target)
    out_shape, dtype = ctx.aval_out.shape, ctx.aval_out.dtype
    in_shape = builder.shape_of(x)
    kernel = _regular_kernel(in_shape, out_shape, nd)
    if kernel is not None:
        return _avg_pool(x, out_shape, dtype, kernel, kernel, [0] * nd, True, None)
    acc = builder.accumulator_dtype(dtype)
    total = builder.contract_trailing(builder.convert(x, acc), [
        _window_matrix(size, out) for size, out in zip(in_shape[-nd:], out_shape[-nd:], strict=True)
    ])
    return builder.convert(hlo.divide(total, _adaptive_counts(in_shape, out_shape, nd, acc)), dtype)


@register_rule(aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool_backward(ctx, grad, x):
    nd = _adaptive_nd(ctx.node.target)
    in_shape, dtype = ctx.aval_out.shape, ctx.aval_out.dtype
    out_shape = builder.shape_of(grad)
    kernel = _regular_kernel(in_shape, out_shape, nd)
    if kernel is not None:
        return _avg_pool_backward(grad, in_shape, dtype, kernel, kernel, [0] * nd, True, None)
    acc = builder.accumulator_dtype(dtype)
    grad = hlo.divide(builder.convert(grad, acc), _adaptive_counts(in_shape, out_shape, nd, acc))
    result = builder.contract_trailing(grad, [
        _window_matrix(size, out).T for size, out in zip(in_shape[-nd:], out_shape[-nd:], strict=True)
    ])
    return builder.convert(result, dtype)


def _take_static(x: Value, dim: int, positions: np.ndarray) -> Value:
    """``x`` indexed along ``dim`` with a constant vector of positions (the dim's size becomes its length)."""
    shape = builder.shape_of(x)
    starts = builder.dense_constant(torch.from_numpy(positions.astype(np.int64).reshape(-1, 1)))
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[d for d in range(len(shape)) if d != dim],
        collapsed_slice_dims=[dim],
        operand_batching_dims=[],
        start_indices_batching_dims=[],
        start_index_map=[dim],
        index_vector_dim=1,
    )
    return hlo.gather(x, starts, numbers, [1 if d == dim else s for d, s in enumerate(shape)])


def _adaptive_max(x: Value, out_shape: Sequence[int], nd: int) -> list[Value]:
    """Irregular adaptive max pooling: gather every window (``(..., O1, k1, O2, k2, ...)``, short windows
    repeating their last element, which changes neither the max nor the first index) and reduce it."""
    shape = builder.shape_of(x)
    lead = len(shape) - nd
    positions = []
    for size, out in zip(shape[-nd:], out_shape[-nd:], strict=True):
        windows = _adaptive_windows(size, out)
        width = max(end - start for start, end in windows)
        positions.append(np.asarray([[min(start + j, end - 1) for j in range(width)] for start, end in windows]))
    gathered = x
    for i, pos in enumerate(positions):
        gathered = _take_static(gathered, lead + i, pos.reshape(-1))
    window_shape = [n for pos in positions for n in pos.shape]
    gathered = builder.reshape(gathered, (*shape[:lead], *window_shape))
    flat = np.zeros((), dtype=np.int64)
    for size, pos in zip(shape[-nd:], positions, strict=True):
        flat = np.add.outer(flat * size, pos)  # (O1, k1, O2, k2, ...): the flat index in the input plane
    indices = builder.broadcast_in_dims(
        builder.dense_constant(torch.from_numpy(flat)), builder.shape_of(gathered), range(lead, lead + 2 * nd)
    )
    window_dims = [lead + 2 * i + 1 for i in range(nd)]
    return builder.reduce(
        [gathered, indices], _argmax_inits(builder.dtype_of(x)), window_dims, _argmax_combiner(builder.dtype_of(x))
    )


@register_rule(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def _adaptive_max_pool(ctx, x, output_size):
    nd = _adaptive_nd(ctx.node.target)
    out_shape = ctx.aval_out.shape
    kernel = _regular_kernel(builder.shape_of(x), out_shape, nd)
    if kernel is not None:
        return _max_pool(x, out_shape, kernel, kernel, [0] * nd, [1] * nd)
    return _adaptive_max(x, out_shape, nd)


@register_rule(aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default)
def _adaptive_max_pool_backward(ctx, grad, x, indices):
    return _scatter_to_indices(ctx, grad, indices, _adaptive_nd(ctx.node.target))
