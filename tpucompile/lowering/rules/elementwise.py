"""Binary elementwise arithmetic, comparisons, logical and bitwise ops, where and clamp.

Type promotion and broadcasting are done by the registry (``promote=``); these rules only choose the
StableHLO op and add PyTorch's own semantics where StableHLO differs (Python-style ``remainder``, floor
division, ``alpha`` scaling).
"""

from __future__ import annotations

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import PromotionKind as K
from tpucompile.lowering.registry import always, register_rule
from tpucompile.lowering.types import tensor_type

aten = torch.ops.aten


def _unit_alpha(args, kwargs) -> bool:
    """An ``add``/``sub`` without scaling: ``a + alpha * b`` rounds once in f32, twice narrow."""
    return kwargs.get("alpha", 1) == 1 and (len(args) < 3 or args[2] == 1)


def _squares(args, kwargs) -> bool:
    """``x ** 2``, one product; other powers round more than once narrow, or call ``pow``."""
    exponent = args[1] if len(args) > 1 else None
    return isinstance(exponent, (int, float)) and exponent == 2  # True == 1, so a bool never passes


@register_rule(aten.add.Tensor, aten.add.Scalar, promote=K.DEFAULT, operands=(0, 1), exact_narrow=_unit_alpha)
def _add(ctx, a, b, alpha=1):
    return hlo.add(a, builder.scaled(b, alpha))


@register_rule(aten.sub.Tensor, aten.sub.Scalar, promote=K.DEFAULT, operands=(0, 1), exact_narrow=_unit_alpha)
def _sub(ctx, a, b, alpha=1):
    return hlo.subtract(a, builder.scaled(b, alpha))


@register_rule(aten.rsub.Tensor, aten.rsub.Scalar, promote=K.DEFAULT, operands=(0, 1), exact_narrow=_unit_alpha)
def _rsub(ctx, a, b, alpha=1):
    return hlo.subtract(b, builder.scaled(a, alpha))


@register_rule(aten.mul.Tensor, aten.mul.Scalar, promote=K.DEFAULT, exact_narrow=always)
def _mul(ctx, a, b):
    if builder.dtype_of(a) is torch.bool:
        return hlo.and_(a, b)
    return hlo.multiply(a, b)


@register_rule(aten.div.Tensor, aten.div.Scalar, promote=K.INT_TO_FLOAT)
def _true_divide(ctx, a, b):
    return hlo.divide(a, b)


def floor_divide(a: ir.Value, b: ir.Value) -> ir.Value:
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


@register_rule(aten.div.Tensor_mode, aten.div.Scalar_mode, promote=K.DEFAULT, operands=(0, 1))
def _divide_with_mode(ctx, a, b, rounding_mode=None):
    if rounding_mode is None:
        if not builder.dtype_of(a).is_floating_point:
            dtype = ctx.aval_out.dtype
            return hlo.divide(builder.convert(a, dtype), builder.convert(b, dtype))
        return hlo.divide(a, b)
    if rounding_mode == "trunc":
        return hlo.divide(a, b) if not builder.dtype_of(a).is_floating_point else builder.trunc(hlo.divide(a, b))
    return floor_divide(a, b)


@register_rule(aten.floor_divide.default, aten.floor_divide.Scalar, promote=K.DEFAULT)
def _floor_divide(ctx, a, b):
    return floor_divide(a, b)


@register_rule(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, promote=K.DEFAULT)
def _remainder(ctx, a, b):
    """Python-style modulus: the result takes the sign of the divisor."""
    dtype, shape = builder.dtype_of(a), builder.shape_of(a)
    zero = builder.constant(0, dtype, shape)
    rem = hlo.remainder(a, b)
    signs_differ = builder.compare(builder.compare(rem, zero, "LT"), builder.compare(b, zero, "LT"), "NE")
    fix = hlo.and_(builder.compare(rem, zero, "NE"), signs_differ)
    return builder.select(fix, hlo.add(rem, b), rem)


@register_rule(aten.fmod.Tensor, aten.fmod.Scalar, promote=K.DEFAULT)
def _fmod(ctx, a, b):
    return hlo.remainder(a, b)


_POW_FAST_PATH_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@register_rule(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar, promote=K.BOOL_TO_LONG,
               exact_narrow=_squares)
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


@register_rule(aten.maximum.default, promote=K.DEFAULT, exact_narrow=always)
def _maximum(ctx, a, b):
    return hlo.maximum(a, b)  # StableHLO's maximum propagates NaN, as torch.maximum does


@register_rule(aten.minimum.default, promote=K.DEFAULT, exact_narrow=always)
def _minimum(ctx, a, b):
    return hlo.minimum(a, b)


@register_rule(aten.fmax.default, promote=K.DEFAULT, exact_narrow=always)
def _fmax(ctx, a, b):
    """``maximum`` that ignores a NaN operand (NaN only when both are NaN)."""
    return _ignoring_nan(a, b, hlo.maximum(a, b))


@register_rule(aten.fmin.default, promote=K.DEFAULT, exact_narrow=always)
def _fmin(ctx, a, b):
    return _ignoring_nan(a, b, hlo.minimum(a, b))


def _ignoring_nan(a, b, result):
    if not builder.dtype_of(a).is_floating_point:
        return result
    return builder.select(builder.is_nan(a), b, builder.select(builder.is_nan(b), a, result))


@register_rule(aten.atan2.default, promote=K.INT_TO_FLOAT)
def _atan2(ctx, a, b):
    return hlo.atan2(a, b)


@register_rule(aten.clamp.default, aten.clamp.Tensor, promote=K.DEFAULT, operands=(0, 1, 2), exact_narrow=always)
def _clamp(ctx, x, min=None, max=None):
    if min is not None:
        x = hlo.maximum(x, min)
    if max is not None:
        x = hlo.minimum(x, max)
    return x


@register_rule(aten.clamp_min.default, aten.clamp_min.Tensor, promote=K.DEFAULT, exact_narrow=always)
def _clamp_min(ctx, x, bound):
    return hlo.maximum(x, bound)


@register_rule(aten.clamp_max.default, aten.clamp_max.Tensor, promote=K.DEFAULT, exact_narrow=always)
def _clamp_max(ctx, x, bound):
    return hlo.minimum(x, bound)


@register_rule(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,
                   promote=K.NO_OPMATH, operands=(1, 2))
def _where(ctx, condition, a, b):
    if not hasattr(condition, "type"):
        condition = builder.constant(condition, torch.bool, ctx.aval_out.shape)
    condition = builder.broadcast_to(builder.convert(condition, torch.bool), ctx.aval_out.shape)
    return builder.select(condition, a, b)


def _register_comparison(direction: str, *ops) -> None:
    def rule(ctx, a, b):
        return builder.compare(a, b, direction)

    register_rule(*ops, promote=K.ALWAYS_BOOL, exact_narrow=always)(rule)


_register_comparison("EQ", aten.eq.Tensor, aten.eq.Scalar)
_register_comparison("NE", aten.ne.Tensor, aten.ne.Scalar)
_register_comparison("LT", aten.lt.Tensor, aten.lt.Scalar)
_register_comparison("LE", aten.le.Tensor, aten.le.Scalar)
_register_comparison("GT", aten.gt.Tensor, aten.gt.Scalar)
_register_comparison("GE", aten.ge.Tensor, aten.ge.Scalar)


def _as_bool(value):
    return builder.convert(value, torch.bool)


@register_rule(aten.logical_and.default, promote=K.ALWAYS_BOOL)
def _logical_and(ctx, a, b):
    return hlo.and_(_as_bool(a), _as_bool(b))


@register_rule(aten.logical_or.default, promote=K.ALWAYS_BOOL)
def _logical_or(ctx, a, b):
    return hlo.or_(_as_bool(a), _as_bool(b))


@register_rule(aten.logical_xor.default, promote=K.ALWAYS_BOOL)
def _logical_xor(ctx, a, b):
    return hlo.xor(_as_bool(a), _as_bool(b))


@register_rule(aten.logical_not.default, promote=K.ALWAYS_BOOL)
def _logical_not(ctx, a):
    return hlo.not_(_as_bool(a))


@register_rule(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_and.Scalar_Tensor,
                   promote=K.DEFAULT)
def _bitwise_and(ctx, a, b):
    return hlo.and_(a, b)


@register_rule(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.bitwise_or.Scalar_Tensor,
                   promote=K.DEFAULT)
def _bitwise_or(ctx, a, b):
    return hlo.or_(a, b)


@register_rule(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_xor.Scalar_Tensor,
                   promote=K.DEFAULT)
def _bitwise_xor(ctx, a, b):
    return hlo.xor(a, b)


@register_rule(aten.bitwise_not.default, promote=K.DEFAULT)
def _bitwise_not(ctx, a):
    return hlo.not_(a)


# --- floating-point bit manipulation: copysign, nextafter, frexp, ldexp, hypot, angle --------------------------

_SAME_WIDTH_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}
_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _bitcast(value, dtype):
    return hlo.bitcast_convert(tensor_type(builder.shape_of(value), dtype), value)


@register_rule(aten.copysign.Tensor, aten.copysign.Scalar, promote=K.INT_TO_FLOAT)
def _copysign(ctx, a, b):
    """The magnitude of ``a`` with the sign bit of ``b`` (NaN and -0.0 included), as C's ``copysign``."""
    dtype = builder.dtype_of(a)
    bits = _SAME_WIDTH_INT[dtype]
    a_bits, b_bits = _bitcast(a, bits), _bitcast(b, bits)
    sign = builder.constant_like(torch.iinfo(bits).min, a_bits)
    magnitude = builder.constant_like(torch.iinfo(bits).max, a_bits)
    return _bitcast(hlo.or_(hlo.and_(a_bits, magnitude), hlo.and_(b_bits, sign)), dtype)


def _ordered(bits):
    """Map float bit patterns to integers ordered as the floats are (-0.0 just below +0.0); an involution."""
    width = torch.iinfo(builder.dtype_of(bits)).bits
    negative = hlo.shift_right_arithmetic(bits, builder.constant_like(width - 1, bits))
    return hlo.xor(bits, hlo.and_(negative, builder.constant_like(torch.iinfo(builder.dtype_of(bits)).max, bits)))


def _is_nan_bits(bits, dtype):
    """NaN test on the bit pattern (float compares may treat subnormals as zero on some backends)."""
    magnitude = hlo.and_(bits, builder.constant_like(torch.iinfo(builder.dtype_of(bits)).max, bits))
    infinity = _bitcast(builder.constant(float("inf"), dtype, builder.shape_of(bits)), builder.dtype_of(bits))
    return builder.compare(magnitude, infinity, "GT")


def _is_zero_bits(bits):
    magnitude = hlo.and_(bits, builder.constant_like(torch.iinfo(builder.dtype_of(bits)).max, bits))
    return builder.compare(magnitude, builder.constant_like(0, bits), "EQ")


@register_rule(aten.nextafter.default, promote=K.NO_OPMATH)
def _nextafter(ctx, a, b):
    """The float after ``a`` toward ``b`` (in the operands' own precision): one step of the bit pattern in
    float order. Tests and selects all work on the bits: XLA's CPU backend runs with subnormals flushed to zero,
    and LLVM turns a bit test of a float feeding a float select back into a float compare, which would then
    see subnormals as zero."""
    dtype = builder.dtype_of(a)
    bits = _SAME_WIDTH_INT[dtype]
    a_bits, b_bits = _bitcast(a, bits), _bitcast(b, bits)
    key_a, key_b = _ordered(a_bits), _ordered(b_bits)
    one = builder.constant_like(1, a_bits)
    stepped = _ordered(builder.select(builder.compare(key_a, key_b, "LT"), hlo.add(key_a, one),
                                      hlo.subtract(key_a, one)))
    zero_a = _is_zero_bits(a_bits)
    smallest = hlo.or_(hlo.and_(b_bits, builder.constant_like(torch.iinfo(bits).min, b_bits)), one)  # toward b from ±0
    result = builder.select(zero_a, smallest, stepped)
    equal = hlo.or_(builder.compare(a_bits, b_bits, "EQ"), hlo.and_(zero_a, _is_zero_bits(b_bits)))
    result = builder.select(equal, b_bits, result)
    either_nan = hlo.or_(_is_nan_bits(a_bits, dtype), _is_nan_bits(b_bits, dtype))
    nan = _bitcast(builder.constant(float("nan"), dtype, builder.shape_of(a)), bits)
    return _bitcast(builder.select(either_nan, nan, result), dtype)


@register_rule(aten.frexp.Tensor)
def _frexp(ctx, x):
    """Mantissa in [0.5, 1) and int32 exponent with ``x == mantissa * 2**exponent``, read off the bits
    (subnormals normalised with a leading-zero count); 0, inf and NaN give themselves and exponent 0. As in
    ``nextafter``, every select is on the bits, never on floats, so that subnormals survive."""
    dtype = builder.dtype_of(x)
    work = builder.accumulator_dtype(dtype)  # an exact widening
    value = builder.convert(x, work)
    bits_dtype = _SAME_WIDTH_INT[work]
    width = torch.iinfo(bits_dtype).bits
    mantissa_bits = _MANTISSA_BITS[work]
    bias_less_one = (1 << (width - mantissa_bits - 2)) - 2  # 126 for float32
    bits = _bitcast(value, bits_dtype)
    shift = builder.constant_like(mantissa_bits, bits)
    exponent_mask = builder.constant_like(((1 << (width - 1 - mantissa_bits)) - 1) << mantissa_bits, bits)
    fraction_mask = builder.constant_like((1 << mantissa_bits) - 1, bits)
    sign = hlo.and_(bits, builder.constant_like(torch.iinfo(bits_dtype).min, bits))
    field = hlo.shift_right_logical(hlo.and_(bits, exponent_mask), shift)
    fraction = hlo.and_(bits, fraction_mask)
    # Subnormals: move the leading 1 of the fraction up to the implicit-bit position.
    lead = hlo.subtract(hlo.count_leading_zeros(fraction), builder.constant_like(width - 1 - mantissa_bits, bits))
    normalised = hlo.and_(hlo.shift_left(fraction, lead), fraction_mask)
    subnormal = builder.compare(field, builder.constant_like(0, field), "EQ")
    fraction = builder.select(subnormal, normalised, fraction)
    exponent = builder.select(
        subnormal,
        hlo.subtract(builder.constant_like(1 - bias_less_one, lead), lead),
        hlo.subtract(field, builder.constant_like(bias_less_one, field)),
    )
    mantissa_field = builder.constant_like(bias_less_one << mantissa_bits, bits)
    mantissa = hlo.or_(hlo.or_(sign, mantissa_field), fraction)
    all_ones = builder.compare(field, hlo.shift_right_logical(exponent_mask, shift), "EQ")  # inf and NaN
    special = hlo.or_(_is_zero_bits(bits), all_ones)
    mantissa = _bitcast(builder.select(special, bits, mantissa), work)
    exponent = builder.select(special, builder.constant_like(0, exponent), exponent)
    return builder.convert(mantissa, dtype), builder.convert(exponent, torch.int32)


@register_rule(aten.ldexp.Tensor, promote=K.INT_TO_FLOAT)
def _ldexp(ctx, a, b):
    """``a * 2 ** b``, as eager computes it (``mul(self, pow(2, other))``)."""
    two = builder.constant(2, builder.dtype_of(b), builder.shape_of(b))
    return hlo.multiply(a, hlo.power(two, b))


@register_rule(aten.hypot.default, promote=K.DEFAULT)
def _hypot(ctx, a, b):
    """``sqrt(a² + b²)`` without overflow: ``big * sqrt(1 + (small / big)²)``; inf if either is infinite."""
    dtype, shape = builder.dtype_of(a), builder.shape_of(a)
    a, b = hlo.abs(a), hlo.abs(b)
    big, small = hlo.maximum(a, b), hlo.minimum(a, b)
    zero, one = builder.constant(0, dtype, shape), builder.constant(1, dtype, shape)
    inf = builder.constant(float("inf"), dtype, shape)
    ratio = hlo.divide(small, big)
    result = hlo.multiply(big, hlo.sqrt(hlo.add(one, hlo.multiply(ratio, ratio))))
    result = builder.select(builder.compare(big, zero, "EQ"), zero, result)
    infinite = hlo.or_(builder.compare(a, inf, "EQ"), builder.compare(b, inf, "EQ"))
    return builder.select(infinite, inf, result)
