"""Matrix products. bf16/f16 products accumulate in f32 (as PyTorch's kernels and TPUs' MXUs do) and round
once: the dot's result type is f32 and a convert follows, which XLA fuses into the dot."""

from __future__ import annotations

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten


def _dot(lhs, rhs, contracting, batch, out_dtype):
    lhs, rhs = builder.convert(lhs, out_dtype), builder.convert(rhs, out_dtype)
    product = builder.dot_general(lhs, rhs, contracting, batch, out_dtype=builder.accumulator_dtype(out_dtype))
    return product


@register_rule(aten.mm.default)
def _mm(ctx, a, b):
    dtype = ctx.aval_out.dtype
    return builder.convert(_dot(a, b, ((1,), (0,)), ((), ()), dtype), dtype)


@register_rule(aten.bmm.default)
def _bmm(ctx, a, b):
    dtype = ctx.aval_out.dtype
    return builder.convert(_dot(a, b, ((2,), (1,)), ((0,), (0,)), dtype), dtype)


@register_rule(aten.dot.default, aten.vdot.default)
def _vector_dot(ctx, a, b):
    dtype = ctx.aval_out.dtype
    return builder.convert(_dot(a, b, ((0,), (0,)), ((), ()), dtype), dtype)


@register_rule(aten.mv.default)
def _mv(ctx, a, b):
    dtype = ctx.aval_out.dtype
    return builder.convert(_dot(a, b, ((1,), (0,)), ((), ()), dtype), dtype)


def _add_bias(ctx, bias, product, beta, alpha):
    """``beta * bias + alpha * product`` in the accumulator dtype; beta == 0 ignores bias (even NaN)."""
    acc = builder.dtype_of(product)
    result = builder.scaled(product, alpha)
    if beta != 0:
        bias = builder.broadcast_to(builder.convert(bias, acc), builder.shape_of(result))
        result = hlo.add(builder.scaled(bias, beta), result)
    return builder.convert(result, ctx.aval_out.dtype)


@register_rule(aten.addmm.default)
def _addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    return _add_bias(ctx, bias, _dot(a, b, ((1,), (0,)), ((), ()), ctx.aval_out.dtype), beta, alpha)


@register_rule(aten.baddbmm.default)
def _baddbmm(ctx, bias, a, b, *, beta=1, alpha=1):
    return _add_bias(ctx, bias, _dot(a, b, ((2,), (1,)), ((0,), (0,)), ctx.aval_out.dtype), beta, alpha)


@register_rule(aten.addmv.default)
def _addmv(ctx, bias, a, b, *, beta=1, alpha=1):
    return _add_bias(ctx, bias, _dot(a, b, ((1,), (0,)), ((), ()), ctx.aval_out.dtype), beta, alpha)
