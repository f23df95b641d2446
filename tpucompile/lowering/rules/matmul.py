"""Matrix products. bf16/f16 products accumulate in f32 (as PyTorch's kernels and TPUs' MXUs do) and round
once.

By default a product is a ``dot_general`` with an f32 result and a ``convert`` to the narrow dtype. With
``narrow_products``, a plain product (``mm``, ``bmm``) is one ``dot_general`` whose result type is the narrow
dtype: the hardware accumulates in f32 and writes the rounded product. Both round the same way, but XLA's TPU
compiler may move the convert into the consumers and keep the f32 product in HBM, at twice the bytes (a
residual stream of f32 layer outputs read back in the backward). Even then the f32 form is kept for a
product a user widens again (an f32 loss or norm reads its f32 product) and a product with a bias
(``addmm``: the bias is added before the one rounding). Off by default: measured on the TPU target, the
narrow form saves cycles but can cost bytes and peak memory (``docs/benchmarks.md``)."""

from __future__ import annotations

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten


_VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.expand.default, aten.clone.default, aten.alias.default,
})
"""Ops that pass a product's values on unchanged, through which a widening user is looked for."""

_WIDENING = frozenset({torch.ops.prims.convert_element_type.default, aten._to_copy.default})


def _dot(lhs, rhs, contracting, batch, out_dtype, accumulated=True):
    """The product of operands taken in ``out_dtype``: with ``accumulated``, its result is in the accumulator
    dtype (f32 for bf16/f16); else in ``out_dtype`` itself, the dot rounding its f32 sums once."""
    lhs, rhs = builder.convert(lhs, out_dtype), builder.convert(rhs, out_dtype)
    result_dtype = builder.accumulator_dtype(out_dtype) if accumulated else out_dtype
    return builder.dot_general(lhs, rhs, contracting, batch, out_dtype=result_dtype)


def _rounded_dot(ctx, lhs, rhs, contracting, batch):
    """The product in the node's dtype, accumulated in its accumulator dtype and rounded once: written narrow
    where the accumulator is wider, unless the product is widened again by a user."""
    dtype = ctx.aval_out.dtype
    narrow = (ctx.narrow_products and builder.accumulator_dtype(dtype) != dtype
              and not _widened_by_a_user(ctx.node, dtype))
    return builder.convert(_dot(lhs, rhs, contracting, batch, dtype, accumulated=not narrow), dtype)


def _widened_by_a_user(node, dtype: torch.dtype) -> bool:
    """Whether a user of ``node``, directly or through views, converts it to a float dtype wider than
    ``dtype``."""
    pending, seen = list(node.users), set()
    while pending:
        user = pending.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        if user.target in _VIEWS:
            pending.extend(user.users)
        elif user.target in _WIDENING:
            wider = user.meta.get("val")
            if (isinstance(wider, torch.Tensor) and wider.dtype.is_floating_point
                    and wider.dtype.itemsize > dtype.itemsize):
                return True
    return False


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
