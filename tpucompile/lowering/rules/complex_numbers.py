"""Complex numbers: building them from parts and taking them apart, conjugates, and the ops whose complex
meaning differs from the real one (``angle``, ``sgn``).

A functional graph holds no lazy conjugate or negative bits: ``_conj`` and ``_neg_view`` are the values they
show, computed here, and ``resolve_conj``/``resolve_neg`` are identities.
"""

from __future__ import annotations

import math

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import PromotionKind as K
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten


def _one_operand(build, *ops) -> None:
    register_rule(*ops)(lambda ctx, x: build(x))


_one_operand(builder.as_float_pairs, aten.view_as_real.default)
_one_operand(builder.from_float_pairs, aten.view_as_complex.default)
_one_operand(builder.real_part, aten.real.default)
_one_operand(builder.imaginary_part, aten.imag.default)
_one_operand(builder.conjugate, aten._conj.default, aten.conj_physical.default, aten._conj_physical.default,
             aten.conj.default)
_one_operand(hlo.negate, aten._neg_view.default)
_one_operand(lambda x: x, aten.resolve_conj.default, aten.resolve_neg.default)


def _as_parts(ctx, *values):
    """Float operands in the result's part dtype (f32 for complex64) and broadcast to its shape."""
    part = ctx.aval_out.dtype.to_real()
    return [builder.broadcast_to(builder.convert(v, part), ctx.aval_out.shape) for v in values]


@register_rule(aten.complex.default)
def _complex(ctx, real, imaginary):
    return builder.from_parts(*_as_parts(ctx, real, imaginary))


@register_rule(aten.polar.default)
def _polar(ctx, magnitude, angle):
    magnitude, angle = _as_parts(ctx, magnitude, angle)
    return builder.from_parts(hlo.multiply(magnitude, hlo.cosine(angle)), hlo.multiply(magnitude, hlo.sine(angle)))


@register_rule(aten.angle.default, promote=K.INT_TO_FLOAT)
def _angle(ctx, x):
    """``atan2(imag, real)`` for complex values; for real ones torch gives π for negatives, NaN for NaN and 0
    otherwise."""
    if builder.dtype_of(x).is_complex:
        return hlo.atan2(hlo.imag(x), hlo.real(x))
    zero = builder.constant_like(0, x)
    negative = builder.compare(x, zero, "LT")
    angle = builder.select(negative, builder.constant_like(math.pi, x), zero)
    return builder.select(builder.is_nan(x), x, angle)
