"""Matrix products. bf16/f16 products accumulate in f32 (as PyTorch's kernels and TPUs' MXUs do) and round
once.

With ``narrow_products`` (the backend decides per program: ``config.narrow_products_for``), a plain product
(``mm``, ``bmm``, ``mv``, ``dot``) is one ``dot_general`` whose result type is the narrow dtype: the hardware
accumulates in f32 and writes the rounded product, as a JAX program's bf16 products do. Without it, the
product is a ``dot_general`` with an f32 result and a ``convert``. Both round the same way; they differ in
what XLA's TPU compiler makes of the program around them (``docs/benchmarks.md``). A product with a bias
(``addmm``) keeps its f32 product either way: the bias is added before the one rounding, as PyTorch does."""

from __future__ import annotations

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten


def _dot(lhs, rhs, contracting, batch, out_dtype, accumulated=True):
    """The product of operands taken in ``out_dtype``: with ``accumulated``, its result is in the accumulator
    dtype (f32 for bf16/f16); else in ``out_dtype`` itself, the dot rounding its f32 sums once."""
    lhs, rhs = builder.convert(lhs, out_dtype), builder.convert(rhs, out_dtype)
    result_dtype = builder.accumulator_dtype(out_dtype) if accumulated else out_dtype
    return builder.dot_general(lhs, rhs, contracting, batch, out_dtype=result_dtype)


def _rounded_dot(ctx, lhs, rhs, contracting, batch):
    """The product in the node's dtype, accumulated in its accumulator dtype and rounded once: written narrow
    where the program writes products narrow and the accumulator is wider."""
    dtype = ctx.aval_out.dtype
    narrow = ctx.narrow_products and builder.accumulator_dtype(dtype) != dtype
    return builder.convert(_dot(lhs, rhs, contracting, batch, dtype, accumulated=not narrow), dtype)


@register_rule(aten.mm.default)
def _mm(ctx, a, b):
    return _rounded_dot(ctx, a, b, ((1,), (0,)), ((), ()))


@register_rule(aten.bmm.default)
def _bmm(ctx, a, b):
    return _rounded_dot(ctx, a, b, ((2,), (1,)), ((0,), (0,)))


@register_rule(aten.dot.default, aten.vdot.default)
def _vector_dot(ctx, a, b):
    return _rounded_dot(ctx, a, b, ((0,), (0,)), ((), ()))


@register_rule(aten.mv.default)
def _mv(ctx, a, b):
    return _rounded_dot(ctx, a, b, ((1,), (0,)), ((), ()))


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
