"""Random number ops: uniform, normal, integer and Bernoulli draws from the program's ``RandomStream``.

Values follow eager PyTorch's distributions, not its exact numbers (see ``lowering/rng.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import chlo
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import tensor_type

aten = torch.ops.aten

# dtype -> (bit width, mantissa bits, the bit pattern of 1.0)
_FLOAT_LAYOUT = {
    torch.float32: (32, 23, 0x3F800000),
    torch.float64: (64, 52, 0x3FF0000000000000),
}


def _unsigned_constant(value: int, bits: int, shape) -> ir.Value:
    type_ = ir.RankedTensorType.get(list(shape), ir.IntegerType.get_unsigned(bits))
    return hlo.constant(ir.DenseElementsAttr.get_splat(type_, ir.IntegerAttr.get(type_.element_type, value)))


def _check_generator(kwargs) -> None:
    if kwargs.get("generator") is not None:
        raise UnsupportedOpError("an explicit torch.Generator is not supported; tpucompile draws from torch's "
                                 "default generator")


def uniform(ctx, shape: Sequence[int], dtype: torch.dtype) -> ir.Value:
    """Uniform floats in [0, 1): random mantissa bits under the exponent of 1.0, minus 1."""
    compute = dtype if dtype in _FLOAT_LAYOUT else torch.float32
    width, mantissa, one_bits = _FLOAT_LAYOUT[compute]
    bits = ctx.random.bits(shape, width)
    shifted = hlo.shift_right_logical(bits, _unsigned_constant(width - mantissa, width, shape))
    with_exponent = hlo.or_(shifted, _unsigned_constant(one_bits, width, shape))
    in_one_two = hlo.bitcast_convert(tensor_type(shape, compute), with_exponent)
    value = hlo.subtract(in_one_two, builder.constant(1.0, compute, shape))
    if compute == dtype:
        return value
    value = builder.convert(value, dtype)
    # Rounding to a narrower float can reach 1.0; keep the interval half-open as torch does.
    below_one = torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()
    return hlo.minimum(value, builder.constant(below_one, dtype, shape))


def normal(ctx, shape: Sequence[int], dtype: torch.dtype) -> ir.Value:
    """Standard normal floats by inverse transform: sqrt(2) * erfinv(2u - 1), u strictly inside (0, 1)."""
    compute = dtype if dtype is torch.float64 else torch.float32
    u = uniform(ctx, shape, compute)
    half_step = 2.0 ** -(_FLOAT_LAYOUT[compute][1] + 1)
    u = hlo.add(u, builder.constant(half_step, compute, shape))
    centered = hlo.subtract(hlo.multiply(u, builder.constant(2.0, compute, shape)),
                            builder.constant(1.0, compute, shape))
    value = hlo.multiply(chlo.erf_inv(centered), builder.constant(math.sqrt(2.0), compute, shape))
    return builder.convert(value, dtype)


@register_rule(aten.rand.default, aten.rand_like.default, random=True)
def _rand(ctx, *args, **kwargs):
    _check_generator(kwargs)
    return uniform(ctx, ctx.aval_out.shape, ctx.aval_out.dtype)


@register_rule(aten.randn.default, aten.randn_like.default, random=True)
def _randn(ctx, *args, **kwargs):
    _check_generator(kwargs)
    return normal(ctx, ctx.aval_out.shape, ctx.aval_out.dtype)


@register_rule(aten.uniform.default, random=True)
def _uniform(ctx, x, low=0.0, high=1.0, **kwargs):
    _check_generator(kwargs)
    spec = ctx.aval_out
    u = uniform(ctx, spec.shape, spec.dtype)
    scale = builder.constant(high - low, spec.dtype, spec.shape)
    return hlo.add(hlo.multiply(u, scale), builder.constant(low, spec.dtype, spec.shape))


@register_rule(aten.normal_functional.default, random=True)
def _normal_functional(ctx, x, mean=0.0, std=1.0, **kwargs):
    _check_generator(kwargs)
    spec = ctx.aval_out
    value = normal(ctx, spec.shape, spec.dtype)
    return hlo.add(hlo.multiply(value, builder.constant(std, spec.dtype, spec.shape)),
                   builder.constant(mean, spec.dtype, spec.shape))


def _randint(ctx, low: int, high: int):
    spec = ctx.aval_out
    span = high - low
    if span <= 0:
        raise UnsupportedOpError(f"randint needs low < high, got [{low}, {high})")
    width = 32 if span <= 2**32 else 64
    bits = ctx.random.bits(spec.shape, width)
    # Modulo of 32 or 64 random bits: the bias is below span / 2**width, far under sampling noise.
    offset = hlo.remainder(bits, _unsigned_constant(span, width, spec.shape)) if span < 2**width else bits
    signed = hlo.convert(tensor_type(spec.shape, torch.int64), offset)
    value = hlo.add(signed, builder.constant(low, torch.int64, spec.shape))
    return builder.convert(value, spec.dtype)


@register_rule(aten.randint.default, random=True)
def _randint_high(ctx, high, size, **kwargs):
    _check_generator(kwargs)
    return _randint(ctx, 0, high)


@register_rule(aten.randint.low, random=True)
def _randint_low(ctx, low, high, size, **kwargs):
    _check_generator(kwargs)
    return _randint(ctx, low, high)


@register_rule(aten.randint_like.default, random=True)
def _randint_like_high(ctx, x, high, **kwargs):
    _check_generator(kwargs)
    return _randint(ctx, 0, high)


@register_rule(aten.randint_like.low_dtype, random=True)
def _randint_like_low(ctx, x, low, high, **kwargs):
    _check_generator(kwargs)
    return _randint(ctx, low, high)


@register_rule(aten.bernoulli.default, random=True)
def _bernoulli(ctx, probabilities, **kwargs):
    """1 where a uniform draw falls below the input's probability."""
    _check_generator(kwargs)
    spec = ctx.aval_out
    compute = torch.float64 if builder.dtype_of(probabilities) is torch.float64 else torch.float32
    u = uniform(ctx, spec.shape, compute)
    hit = builder.compare(u, builder.convert(probabilities, compute), "LT")
    return builder.convert(hit, spec.dtype)


@register_rule(aten.bernoulli.p, random=True)
def _bernoulli_p(ctx, x, p=0.5, **kwargs):
    _check_generator(kwargs)
    spec = ctx.aval_out
    u = uniform(ctx, spec.shape, torch.float32)
    hit = builder.compare(u, builder.constant(p, torch.float32, spec.shape), "LT")
    return builder.convert(hit, spec.dtype)
