"""Softmax and layer norm, lowered whole so that XLA sees one max/sum reduction pair and one fusion.

Low-precision inputs are normalised in f32, as PyTorch's CPU kernels do."""

from __future__ import annotations

import math

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_lowering
from tpucompile.lowering.rules.reductions import reduce_sum

aten = torch.ops.aten


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _reduce_keep(x, dim, combine, init):
    shape = builder.shape_of(x)
    reduced = builder.reduce([x], [builder.constant(init, builder.dtype_of(x), ())], [dim],
                             lambda acc, el: [combine(acc[0], el[0])])[0]
    kept = [1 if i == dim else s for i, s in enumerate(shape)]
    return builder.broadcast_to(builder.reshape(reduced, kept), shape)


def _shifted(ctx, x, dim):
    x = builder.convert(x, _compute_dtype(ctx.aval_out.dtype))
    if builder.rank_of(x) == 0:
        return x, None
    dim %= builder.rank_of(x)
    peak = _reduce_keep(x, dim, hlo.maximum, float("-inf"))
    # An all -inf row would give -inf - -inf = NaN; torch gives NaN too, so no special case is needed.
    return hlo.subtract(x, peak), dim


@register_lowering(aten._softmax.default)
def _softmax(ctx, x, dim, half_to_float=False):
    shifted, dim = _shifted(ctx, x, dim)
    if dim is None:
        return builder.constant(1, ctx.aval_out.dtype, ())
    exp = hlo.exponential(shifted)
    total = _reduce_keep(exp, dim, hlo.add, 0)
    return builder.convert(hlo.divide(exp, total), ctx.aval_out.dtype)


@register_lowering(aten._log_softmax.default)
def _log_softmax(ctx, x, dim, half_to_float=False):
    shifted, dim = _shifted(ctx, x, dim)
    if dim is None:
        return builder.constant(0, ctx.aval_out.dtype, ())
    total = _reduce_keep(hlo.exponential(shifted), dim, hlo.add, 0)
    return builder.convert(hlo.subtract(shifted, hlo.log(total)), ctx.aval_out.dtype)


@register_lowering(aten.native_layer_norm.default)
def _native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    """Returns (output, mean, rstd) with mean/rstd shaped like x with the normalised dims kept as 1."""
    out_dtype = ctx.avals_out[0].dtype
    compute = _compute_dtype(out_dtype)
    x = builder.convert(x, compute)
    shape = builder.shape_of(x)
    axis = len(shape) - len(normalized_shape)
    dims = list(range(axis, len(shape)))
    count = math.prod(shape[d] for d in dims)
    stat_shape = shape[:axis] + (1,) * len(dims)

    def mean_of(value):
        total = reduce_sum(value, dims)
        mean = hlo.divide(total, builder.constant(count, compute, builder.shape_of(total)))
        return builder.reshape(mean, stat_shape)

    mean = mean_of(x)
    centered = hlo.subtract(x, builder.broadcast_to(mean, shape))
    var = mean_of(hlo.multiply(centered, centered))
    rstd = hlo.rsqrt(hlo.add(var, builder.constant(eps, compute, stat_shape)))
    out = hlo.multiply(centered, builder.broadcast_to(rstd, shape))
    if weight is not None:
        out = hlo.multiply(out, builder.broadcast_to(builder.convert(weight, compute), shape))
    if bias is not None:
        out = hlo.add(out, builder.broadcast_to(builder.convert(bias, compute), shape))
    stats_dtype = ctx.avals_out[1].dtype
    return (
        builder.convert(out, out_dtype),
        builder.convert(mean, stats_dtype),
        builder.convert(rstd, stats_dtype),
    )
