"""Unary math and activation functions.

Integer inputs of transcendental functions are promoted to float (``INT_TO_FLOAT``), bf16/f16 are computed
in f32 and rounded once at the end, as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import math

import torch
from jax.extend.mlir.dialects import chlo
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import PromotionKind as K
from tpucompile.lowering.registry import always, register_rule
from tpucompile.lowering.types import tensor_type

aten = torch.ops.aten


def _unary(op, *overloads, promote=K.INT_TO_FLOAT, exact_narrow=None):
    register_rule(*overloads, promote=promote, exact_narrow=exact_narrow)(lambda ctx, x: op(x))


_unary(hlo.exponential, aten.exp.default)
_unary(lambda x: hlo.power(builder.constant_like(2, x), x), aten.exp2.default)  # exact for integer x; exp(x·ln2) is not
_unary(hlo.exponential_minus_one, aten.expm1.default)
_unary(hlo.log, aten.log.default)
_unary(hlo.log_plus_one, aten.log1p.default)
_unary(lambda x: hlo.divide(hlo.log(x), builder.constant_like(math.log(2.0), x)), aten.log2.default)
_unary(lambda x: hlo.divide(hlo.log(x), builder.constant_like(math.log(10.0), x)), aten.log10.default)
_unary(hlo.sqrt, aten.sqrt.default)
_unary(hlo.rsqrt, aten.rsqrt.default)
_unary(hlo.sine, aten.sin.default)
_unary(hlo.cosine, aten.cos.default)
_unary(hlo.tan, aten.tan.default)
_unary(hlo.tanh, aten.tanh.default)
_unary(chlo.asin, aten.asin.default)
_unary(chlo.acos, aten.acos.default)
_unary(chlo.atan, aten.atan.default)
_unary(chlo.sinh, aten.sinh.default)
_unary(chlo.cosh, aten.cosh.default)
_unary(chlo.asinh, aten.asinh.default)
_unary(chlo.acosh, aten.acosh.default)
_unary(chlo.atanh, aten.atanh.default)
_unary(chlo.erf, aten.erf.default)
_unary(chlo.erfc, aten.erfc.default)
_unary(chlo.erf_inv, aten.erfinv.default)
_unary(chlo.lgamma, aten.lgamma.default)
_unary(chlo.digamma, aten.digamma.default)
_unary(hlo.logistic, aten.sigmoid.default)
_unary(lambda x: hlo.divide(builder.constant_like(1, x), x), aten.reciprocal.default)
_unary(hlo.negate, aten.neg.default, promote=K.DEFAULT, exact_narrow=always)
_unary(hlo.abs, aten.abs.default, promote=K.DEFAULT, exact_narrow=always)


def _float_only(op):
    return lambda x: op(x) if builder.dtype_of(x).is_floating_point else x


_unary(_float_only(hlo.floor), aten.floor.default, promote=K.DEFAULT)
_unary(_float_only(hlo.ceil), aten.ceil.default, promote=K.DEFAULT)
_unary(_float_only(hlo.round_nearest_even), aten.round.default, promote=K.DEFAULT)
_unary(builder.trunc, aten.trunc.default, promote=K.DEFAULT)
_unary(lambda x: x, aten.positive.default, promote=K.DEFAULT)


@register_rule(aten.round.decimals, promote=K.DEFAULT)
def _round_decimals(ctx, x, decimals=0):
    """As PyTorch: ``rint(x * 10^d) / 10^d``, or ``rint(x / 10^-d) * 10^-d`` for negative ``d``."""
    if not builder.dtype_of(x).is_floating_point:
        return x
    scale = builder.constant_like(10.0 ** abs(decimals), x)
    if decimals < 0:
        return hlo.multiply(hlo.round_nearest_even(hlo.divide(x, scale)), scale)
    return hlo.divide(hlo.round_nearest_even(hlo.multiply(x, scale)), scale)


@register_rule(aten.sign.default, aten.sgn.default, promote=K.DEFAULT)
def _sign(ctx, x):
    dtype = builder.dtype_of(x)
    if dtype is torch.bool:
        return x
    if not dtype.is_floating_point:
        return hlo.sign(x)
    # PyTorch computes (0 < x) - (x < 0): NaN gives 0 (StableHLO's sign keeps NaN), -0.0 gives +0.0.
    zero = builder.constant_like(0, x)
    positive = builder.convert(builder.compare(x, zero, "GT"), dtype)
    negative = builder.convert(builder.compare(x, zero, "LT"), dtype)
    return hlo.subtract(positive, negative)


@register_rule(aten.signbit.default, promote=K.ALWAYS_BOOL)
def _signbit(ctx, x):
    dtype = builder.dtype_of(x)
    if not dtype.is_floating_point:
        return builder.compare(x, builder.constant_like(0, x), "LT")
    bits = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}[dtype]
    as_int = hlo.bitcast_convert(tensor_type(builder.shape_of(x), bits), x)
    return builder.compare(as_int, builder.constant(0, bits, builder.shape_of(x)), "LT")


def _on_parts(test, combine, x):
    """A float test taken on a complex value's real and imaginary parts and combined (``or_``: a NaN or an
    infinity in either part makes the number one; ``and_``: finite only when both are), as torch does."""
    return combine(test(builder.real_part(x)), test(builder.imaginary_part(x)))


def _is_infinite(x):
    return builder.compare(hlo.abs(x), builder.constant_like(float("inf"), x), "EQ")


@register_rule(aten.isnan.default, promote=K.ALWAYS_BOOL)
def _isnan(ctx, x):
    if builder.dtype_of(x).is_complex:
        return _on_parts(builder.is_nan, hlo.or_, x)
    if not builder.dtype_of(x).is_floating_point:
        return builder.constant(False, torch.bool, builder.shape_of(x))
    return builder.is_nan(x)


@register_rule(aten.isinf.default, promote=K.ALWAYS_BOOL)
def _isinf(ctx, x):
    if builder.dtype_of(x).is_complex:
        return _on_parts(_is_infinite, hlo.or_, x)
    if not builder.dtype_of(x).is_floating_point:
        return builder.constant(False, torch.bool, builder.shape_of(x))
    return _is_infinite(x)


@register_rule(aten.isfinite.default, promote=K.ALWAYS_BOOL)
def _isfinite(ctx, x):
    if builder.dtype_of(x).is_complex:
        return _on_parts(hlo.is_finite, hlo.and_, x)
    if not builder.dtype_of(x).is_floating_point:
        return builder.constant(True, torch.bool, builder.shape_of(x))
    return hlo.is_finite(x)


@register_rule(aten.relu.default, promote=K.DEFAULT)
def _relu(ctx, x):
    if builder.dtype_of(x) is torch.bool:
        return x
    return hlo.maximum(x, builder.constant_like(0, x))


@register_rule(aten.gelu.default, promote=K.DEFAULT)
def _gelu(ctx, x, approximate="none"):
    half = builder.constant_like(0.5, x)
    one = builder.constant_like(1.0, x)
    if approximate == "tanh":
        inner = hlo.multiply(
            builder.constant_like(math.sqrt(2.0 / math.pi), x),
            hlo.add(x, hlo.multiply(builder.constant_like(0.044715, x), hlo.multiply(x, hlo.multiply(x, x)))),
        )
        return hlo.multiply(hlo.multiply(half, x), hlo.add(one, hlo.tanh(inner)))
    # x * Φ(x) with Φ(x) = erfc(-x / √2) / 2: no cancellation in 1 + erf(x / √2) for negative x.
    cdf = hlo.multiply(half, chlo.erfc(hlo.multiply(x, builder.constant_like(-1.0 / math.sqrt(2.0), x))))
    return hlo.multiply(x, cdf)


@register_rule(aten.silu.default, promote=K.DEFAULT)
def _silu(ctx, x):
    return hlo.multiply(x, hlo.logistic(x))


@register_rule(aten.nan_to_num.default, promote=K.DEFAULT)
def _nan_to_num(ctx, x, nan=None, posinf=None, neginf=None):
    dtype = builder.dtype_of(x)
    if not dtype.is_floating_point:
        return x
    info = torch.finfo(ctx.aval_out.dtype)  # the bounds of the result dtype, not of the (f32) compute dtype
    x = builder.select(builder.is_nan(x), builder.constant_like(0.0 if nan is None else nan, x), x)
    x = builder.select(builder.compare(x, builder.constant_like(float("inf"), x), "EQ"),
                       builder.constant_like(info.max if posinf is None else posinf, x), x)
    return builder.select(builder.compare(x, builder.constant_like(float("-inf"), x), "EQ"),
                          builder.constant_like(info.min if neginf is None else neginf, x), x)


@register_rule(aten.leaky_relu.default, promote=K.DEFAULT, operands=(0,))
def _leaky_relu(ctx, x, negative_slope=0.01):
    positive = builder.compare(x, builder.constant_like(0, x), "GT")
    return builder.select(positive, x, hlo.multiply(x, builder.constant_like(negative_slope, x)))


@register_rule(aten.hardtanh.default, promote=K.DEFAULT, operands=(0,))
def _hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    """A clamp: NaN stays NaN, and ``min_val > max_val`` gives ``max_val``, as in eager."""
    return hlo.minimum(hlo.maximum(x, builder.constant_like(min_val, x)), builder.constant_like(max_val, x))


@register_rule(aten.elu.default, promote=K.DEFAULT, operands=(0,))
def _elu(ctx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    """``scale * x`` for ``x > 0``, else ``alpha * scale * expm1(input_scale * x)`` (ELU, SELU, CELU)."""
    # alpha * scale rounded to x's dtype, as eager rounds it
    coefficient = hlo.multiply(builder.constant_like(alpha, x), builder.constant_like(scale, x))
    inner = hlo.multiply(x, builder.constant_like(input_scale, x))
    negative = hlo.multiply(hlo.exponential_minus_one(inner), coefficient)
    positive = hlo.multiply(x, builder.constant_like(scale, x))
    return builder.select(builder.compare(x, builder.constant_like(0, x), "LE"), negative, positive)
