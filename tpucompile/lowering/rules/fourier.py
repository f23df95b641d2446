"""Discrete Fourier transforms: ATen's three FFT primitives on ``stablehlo.fft``.

Every ``torch.fft`` function reaches the graph as ``_fft_c2c``, ``_fft_r2c`` or ``_fft_c2r`` over a list of
dimensions, with a normalisation mode (0: none, 1: 1/sqrt(n), 2: 1/n) applied whatever the direction.
``stablehlo.fft`` transforms only the trailing one to three dimensions and always divides its inverse by n,
so a rule moves the transformed dimensions last, splits more than three into separable passes, and folds
XLA's inverse scale into torch's own in one multiply.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder, dynamic_sizes
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import tensor_type

aten = torch.ops.aten

_MOST_DIMS_PER_FFT = 3
_NORMALISATION_NONE, _NORMALISATION_BY_ROOT_N, _NORMALISATION_BY_N = 0, 1, 2


def _fft(value: ir.Value, kind: str, lengths: Sequence[int], result_dtype: torch.dtype) -> ir.Value:
    """One ``stablehlo.fft`` over the trailing ``len(lengths)`` dimensions."""
    shape = list(builder.shape_of(value))
    if kind == "RFFT":
        shape[-1] = lengths[-1] // 2 + 1
    elif kind == "IRFFT":
        shape[-1] = lengths[-1]
    return hlo.fft(value, hlo.FftTypeAttr.get(kind), list(lengths),
                   results=[tensor_type(tuple(shape), result_dtype)])


def _to_end(value: ir.Value, dims: Sequence[int]) -> tuple[ir.Value, list[int]]:
    """``value`` with ``dims`` moved last in that order, and the permutation that moves them back."""
    rank = builder.rank_of(value)
    order = [d for d in range(rank) if d not in dims] + list(dims)
    inverse = [order.index(d) for d in range(rank)]
    return builder.transpose(value, order), inverse


def _in_passes(count: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most three trailing dimensions covering the last ``count``, innermost
    first."""
    ranges, stop = [], count
    while stop > 0:
        start = max(0, stop - _MOST_DIMS_PER_FFT)
        ranges.append((start, stop))
        stop = start
    return ranges


def _applied_last(value: ir.Value, dims: Sequence[int], transform) -> ir.Value:
    """``transform`` of ``value`` with ``dims`` moved last (in that order), its result moved back."""
    moved, back = _to_end(value, dims)
    return builder.transpose(transform(moved), back)


def _complex_passes(value: ir.Value, count: int, kind: str) -> ir.Value:
    """FFT or IFFT over the trailing ``count`` dimensions of a complex value, three at a time (the
    transform is separable, so the passes may run in any order)."""
    rank = builder.rank_of(value)
    dtype = builder.dtype_of(value)
    for start, stop in _in_passes(count):
        value = _applied_last(value, range(rank - count + start, rank - count + stop),
                              functools.partial(_fft_trailing, kind=kind, count=stop - start, dtype=dtype))
    return value


def _fft_trailing(value: ir.Value, kind: str, count: int, dtype: torch.dtype) -> ir.Value:
    """``_fft`` over the trailing ``count`` dimensions at their own sizes."""
    return _fft(value, kind, builder.shape_of(value)[-count:], dtype)


def _scale(value: ir.Value, normalization: int, signal_size: int, inverse: bool) -> ir.Value:
    """Torch's normalisation, with XLA's 1/n of an inverse transform undone in the same factor."""
    factor = {_NORMALISATION_NONE: 1.0, _NORMALISATION_BY_ROOT_N: 1.0 / math.sqrt(signal_size),
              _NORMALISATION_BY_N: 1.0 / signal_size}[normalization]
    if inverse:
        factor *= signal_size
    if factor == 1.0:
        return value
    return hlo.multiply(value, builder.constant_like(factor, value))


def _dims(dims: Sequence[int], rank: int) -> list[int]:
    return [d % rank for d in dims]


def _fixed(ctx, x: ir.Value) -> ir.Value:
    """``x`` in a shape XLA takes as fixed: XLA cannot carry a runtime size through ``fft`` (padding admits only
    transforms over dims that are not padded, so each padded position is a transform of its own)."""
    return dynamic_sizes.fixed_where_padded(x, ctx.operand_metas[0], ctx.extent, ctx.fixed_in_place)


@register_rule(aten._fft_c2c.default)
def _fft_c2c(ctx, x, dim, normalization, forward):
    dims = _dims(dim, builder.rank_of(x))
    if not dims:
        return x
    x = _fixed(ctx, x)
    moved, back = _to_end(x, dims)
    signal = math.prod(builder.shape_of(moved)[-len(dims):])
    out = _complex_passes(moved, len(dims), "FFT" if forward else "IFFT")
    return builder.transpose(_scale(out, normalization, signal, not forward), back)


@register_rule(aten._fft_r2c.default)
def _fft_r2c(ctx, x, dim, normalization, onesided):
    out_dtype = ctx.aval_out.dtype
    dims = _dims(dim, builder.rank_of(x))
    moved, back = _to_end(_fixed(ctx, x), dims)
    signal = math.prod(builder.shape_of(moved)[-len(dims):])
    if not onesided:
        out = _complex_passes(builder.convert(moved, out_dtype), len(dims), "FFT")
    else:
        # the halved (last) dimension and up to two more in one real transform, the rest complex
        real_count = min(len(dims), _MOST_DIMS_PER_FFT)
        shape = builder.shape_of(moved)
        out = _fft(builder.convert(moved, out_dtype.to_real()), "RFFT", shape[len(shape) - real_count:],
                   out_dtype)
        if len(dims) > real_count:
            out = _leading_complex_passes(out, len(dims), real_count, "FFT")
    return builder.transpose(_scale(out, normalization, signal, False), back)


def _leading_complex_passes(value: ir.Value, count: int, done: int, kind: str) -> ir.Value:
    """FFT or IFFT over the ``count - done`` dimensions just before the trailing ``done`` ones."""
    rank = builder.rank_of(value)
    return _applied_last(value, range(rank - count, rank - done),
                         lambda v: _complex_passes(v, count - done, kind))


@register_rule(aten._fft_c2r.default)
def _fft_c2r(ctx, x, dim, normalization, last_dim_size):
    dims = _dims(dim, builder.rank_of(x))
    moved, back = _to_end(_fixed(ctx, x), dims)
    half = last_dim_size // 2 + 1
    moved = _resized_last(moved, half)
    real_count = min(len(dims), _MOST_DIMS_PER_FFT)
    if len(dims) > real_count:
        moved = _leading_complex_passes(moved, len(dims), real_count, "IFFT")
    shape = builder.shape_of(moved)
    lengths = [*shape[len(shape) - real_count:-1], last_dim_size]
    out = _fft(moved, "IRFFT", lengths, ctx.aval_out.dtype)
    signal = math.prod(shape[len(shape) - len(dims):-1]) * last_dim_size
    return builder.transpose(_scale(out, normalization, signal, True), back)


def _resized_last(value: ir.Value, size: int) -> ir.Value:
    """The last dimension cut or zero-padded to ``size`` (the Hermitian half an inverse real FFT reads)."""
    shape = builder.shape_of(value)
    if shape[-1] == size:
        return value
    if shape[-1] > size:
        return builder.slice_along(value, len(shape) - 1, 0, size)
    zero = builder.constant(0, builder.dtype_of(value), ())
    rank = len(shape)
    return hlo.pad(value, zero, [0] * rank, [0] * (rank - 1) + [size - shape[-1]], [0] * rank)


@register_rule(aten.fft_fftfreq.default)
def _fftfreq(ctx, n, d=1.0, **_):
    """``[0, 1, …, -(n // 2), …, -1] / (d·n)``: indices past the middle count back from ``n``."""
    dtype = ctx.aval_out.dtype
    index = builder.iota((n,), torch.int64, 0)
    wrapped = builder.select(builder.compare(index, builder.constant((n + 1) // 2, torch.int64, (n,)), "LT"),
                             index, hlo.subtract(index, builder.constant(n, torch.int64, (n,))))
    return builder.scaled(builder.convert(wrapped, dtype), 1.0 / (n * d))


@register_rule(aten.fft_rfftfreq.default)
def _rfftfreq(ctx, n, d=1.0, **_):
    """``[0, 1, …, n // 2] / (d·n)``: the frequencies of a one-sided transform."""
    count = n // 2 + 1
    return builder.scaled(builder.iota((count,), ctx.aval_out.dtype, 0), 1.0 / (n * d))
