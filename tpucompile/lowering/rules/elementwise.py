"""Binary elementwise arithmetic, comparisons, logical and bitwise ops, where and clamp.

Type promotion and broadcasting are done by the registry (``promote=``); these rules only choose the
StableHLO op and add PyTorch's own semantics where StableHLO differs (Python-style ``remainder``, floor
division, ``alpha`` scaling).
"""

from __future__ import annotations

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import PromotionKind as K
from tpucompile.lowering.registry import register_lowering

aten = torch.ops.aten


def _scaled(ctx, value, alpha):
    if alpha == 1:
        return value
    return hlo.multiply(value, builder.constant(alpha, builder.dtype_of(value), builder.shape_of(value)))


@register_lowering(aten.add.Tensor, aten.add.Scalar, promote=K.DEFAULT, operands=(0, 1))
def _add(ctx, a, b, alpha=1):
    return hlo.add(a, _scaled(ctx, b, alpha))


@register_lowering(aten.sub.Tensor, aten.sub.Scalar, promote=K.DEFAULT, operands=(0, 1))
def _sub(ctx, a, b, alpha=1):
    return hlo.subtract(a, _scaled(ctx, b, alpha))


@register_lowering(aten.rsub.Tensor, aten.rsub.Scalar, promote=K.DEFAULT, operands=(0, 1))
def _rsub(ctx, a, b, alpha=1):
    return hlo.subtract(b, _scaled(ctx, a, alpha))


@register_lowering(aten.mul.Tensor, aten.mul.Scalar, promote=K.DEFAULT)
def _mul(ctx, a, b):
    if builder.dtype_of(a) is torch.bool:
        return hlo.and_(a, b)
    return hlo.multiply(a, b)


@register_lowering(aten.div.Tensor, aten.div.Scalar, promote=K.INT_TO_FLOAT)
def _true_divide(ctx, a, b):
    return hlo.divide(a, b)


def floor_divide(a, b):
    """Division rounding toward -inf, as ``torch.div(..., rounding_mode="floor")``."""
    dtype = builder.dtype_of(a)
    shape = builder.shape_of(a)
    zero = builder.constant(0, dtype, shape)
    if not dtype.is_floating_point:
        quotient = hlo.divide(a, b)  # truncates toward zero
        remainder = hlo.remainder(a, b)
        signs_differ = builder.compare(
            builder.compare(remainder, zero, "LT"), builder.compare(b, zero, "LT"), "NE"
        )
        needs_fix = hlo.and_(builder.compare(remainder, zero, "NE"), signs_differ)
        return builder.select(needs_fix, hlo.subtract(quotient, builder.constant(1, dtype, shape)), quotient)
    # PyTorch's float floor division: exact multiple of b removed first, then floor, then a rounding fix-up.
    mod = hlo.remainder(a, b)
    div = hlo.divide(hlo.subtract(a, mod), b)
    mod_nonzero = builder.compare(mod, zero, "NE")
    signs_differ = builder.compare(builder.compare(b, zero, "LT"), builder.compare(mod, zero, "LT"), "NE")
    div = builder.select(
        hlo.and_(mod_nonzero, signs_differ), hlo.subtract(div, builder.constant(1, dtype, shape)), div
    )
    floored = hlo.floor(div)
    round_up = builder.compare(hlo.subtract(div, floored), builder.constant(0.5, dtype, shape), "GT")
    floored = builder.select(round_up, hlo.add(floored, builder.constant(1, dtype, shape)), floored)
    plain = hlo.divide(a, b)
    signed_zero = hlo.multiply(zero, plain)  # 0 carrying the sign of a / b
    result = builder.select(builder.compare(div, zero, "NE"), floored, signed_zero)
    return builder.select(builder.compare(b, zero, "EQ"), plain, result)


def trunc(value):
    if not builder.dtype_of(value).is_floating_point:
        return value
    negative = builder.compare(value, builder.constant(0, builder.dtype_of(value), builder.shape_of(value)), "LT")
    return builder.select(negative, hlo.ceil(value), hlo.floor(value))


@register_lowering(aten.div.Tensor_mode, aten.div.Scalar_mode, promote=K.DEFAULT, operands=(0, 1))
def _divide_with_mode(ctx, a, b, rounding_mode=None):
    if rounding_mode is None:
        if not builder.dtype_of(a).is_floating_point:
            dtype = ctx.aval_out.dtype
            return hlo.divide(builder.convert(a, dtype), builder.convert(b, dtype))
        return hlo.divide(a, b)
    if rounding_mode == "trunc":
        return hlo.divide(a, b) if not builder.dtype_of(a).is_floating_point else trunc(hlo.divide(a, b))
    return floor_divide(a, b)


@register_lowering(aten.floor_divide.default, aten.floor_divide.Scalar, promote=K.DEFAULT)
def _floor_divide(ctx, a, b):
    return floor_divide(a, b)


@register_lowering(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, promote=K.DEFAULT)
def _remainder(ctx, a, b):
    """Python-style modulus: the result takes the sign of the divisor."""
    dtype, shape = builder.dtype_of(a), builder.shape_of(a)
    zero = builder.constant(0, dtype, shape)
    rem = hlo.remainder(a, b)
    signs_differ = builder.compare(builder.compare(rem, zero, "LT"), builder.compare(b, zero, "LT"), "NE")
    fix = hlo.and_(builder.compare(rem, zero, "NE"), signs_differ)
    return builder.select(fix, hlo.add(rem, b), rem)


@register_lowering(aten.fmod.Tensor, aten.fmod.Scalar, promote=K.DEFAULT)
def _fmod(ctx, a, b):
    return hlo.remainder(a, b)


_POW_FAST_PATH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@register_lowering(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar, promote=K.BOOL_TO_LONG)
def _pow(ctx, a, b):
    exponent = ctx.node.args[1] if ctx.node.target is aten.pow.Tensor_Scalar else None
    if isinstance(exponent, (int, float)) and ctx.aval_out.dtype in _POW_FAST_PATH_DTYPES:
        # PyTorch's CPU kernel computes these exponents with dedicated functions, not ``pow``; they differ
        # from C ``pow`` on special values (``(-inf) ** 0.5`` is NaN, ``(-0.0) ** -0.5`` is -inf).
        one = builder.constant(1, builder.dtype_of(a), builder.shape_of(a))
        if exponent == 0.5:
            return hlo.sqrt(a)
        if exponent == -0.5:
            return hlo.rsqrt(a)
        if exponent == -1:
            return hlo.divide(one, a)
        if exponent == 2:
            return hlo.multiply(a, a)
        if exponent == 3:
            return hlo.multiply(hlo.multiply(a, a), a)
        if exponent == -2:
            return hlo.divide(one, hlo.multiply(a, a))
    return hlo.power(a, b)


@register_lowering(aten.maximum.default, promote=K.DEFAULT)
def _maximum(ctx, a, b):
    return hlo.maximum(a, b)  # StableHLO's maximum propagates NaN, as torch.maximum does


@register_lowering(aten.minimum.default, promote=K.DEFAULT)
def _minimum(ctx, a, b):
    return hlo.minimum(a, b)


@register_lowering(aten.fmax.default, promote=K.DEFAULT)
def _fmax(ctx, a, b):
    """``maximum`` that ignores a NaN operand (NaN only when both are NaN)."""
    return _ignoring_nan(a, b, hlo.maximum(a, b))


@register_lowering(aten.fmin.default, promote=K.DEFAULT)
def _fmin(ctx, a, b):
    return _ignoring_nan(a, b, hlo.minimum(a, b))


def _ignoring_nan(a, b, result):
    if not builder.dtype_of(a).is_floating_point:
        return result
    return builder.select(builder.is_nan(a), b, builder.select(builder.is_nan(b), a, result))


@register_lowering(aten.atan2.default, promote=K.INT_TO_FLOAT)
def _atan2(ctx, a, b):
    return hlo.atan2(a, b)


@register_lowering(aten.clamp.default, aten.clamp.Tensor, promote=K.DEFAULT, operands=(0, 1, 2))
def _clamp(ctx, x, min=None, max=None):
    if min is not None:
        x = hlo.maximum(x, min)
    if max is not None:
        x = hlo.minimum(x, max)
    return x


@register_lowering(aten.clamp_min.default, aten.clamp_min.Tensor, promote=K.DEFAULT)
def _clamp_min(ctx, x, bound):
    return hlo.maximum(x, bound)


@register_lowering(aten.clamp_max.default, aten.clamp_max.Tensor, promote=K.DEFAULT)
def _clamp_max(ctx, x, bound):
    return hlo.minimum(x, bound)


@register_lowering(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,
                   promote=K.NO_OPMATH, operands=(1, 2))
def _where(ctx, condition, a, b):
    if not hasattr(condition, "type"):
        condition = builder.constant(condition, torch.bool, ctx.aval_out.shape)
    condition = builder.broadcast_to(builder.convert(condition, torch.bool), ctx.aval_out.shape)
    return builder.select(condition, a, b)


def _register_comparison(direction: str, *ops) -> None:
    def rule(ctx, a, b):
        return builder.compare(a, b, direction)

    register_lowering(*ops, promote=K.ALWAYS_BOOL)(rule)


_register_comparison("EQ", aten.eq.Tensor, aten.eq.Scalar)
_register_comparison("NE", aten.ne.Tensor, aten.ne.Scalar)
_register_comparison("LT", aten.lt.Tensor, aten.lt.Scalar)
_register_comparison("LE", aten.le.Tensor, aten.le.Scalar)
_register_comparison("GT", aten.gt.Tensor, aten.gt.Scalar)
_register_comparison("GE", aten.ge.Tensor, aten.ge.Scalar)


def _as_bool(value):
    return builder.convert(value, torch.bool)


@register_lowering(aten.logical_and.default, promote=K.ALWAYS_BOOL)
def _logical_and(ctx, a, b):
    return hlo.and_(_as_bool(a), _as_bool(b))


@register_lowering(aten.logical_or.default, promote=K.ALWAYS_BOOL)
def _logical_or(ctx, a, b):
    return hlo.or_(_as_bool(a), _as_bool(b))


@register_lowering(aten.logical_xor.default, promote=K.ALWAYS_BOOL)
def _logical_xor(ctx, a, b):
    return hlo.xor(_as_bool(a), _as_bool(b))


@register_lowering(aten.logical_not.default, promote=K.ALWAYS_BOOL)
def _logical_not(ctx, a):
    return hlo.not_(_as_bool(a))


@register_lowering(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_and.Scalar_Tensor,
                   promote=K.DEFAULT)
def _bitwise_and(ctx, a, b):
    return hlo.and_(a, b)


@register_lowering(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.bitwise_or.Scalar_Tensor,
                   promote=K.DEFAULT)
def _bitwise_or(ctx, a, b):
    return hlo.or_(a, b)


@register_lowering(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_xor.Scalar_Tensor,
                   promote=K.DEFAULT)
def _bitwise_xor(ctx, a, b):
    return hlo.xor(a, b)


@register_lowering(aten.bitwise_not.default, promote=K.DEFAULT)
def _bitwise_not(ctx, a):
    return hlo.not_(a)
