"""Cumulative extremes ``cummax`` / ``cummin`` (values and int64 indices), on ``builder.scan``.

The scan's reduction order is unspecified, so its combiner must be associative and commutative; the extremes
are made so by ordering (value, index) pairs totally:

* ``cummax``: NaN beats everything, then the larger value, then the later index (PyTorch compares with
  ``>=``, so the last of equal maxima is reported, and the index of the last NaN once one was seen);
* ``cummin``: the same with the smaller value.

``cumsum`` / ``cumprod`` / ``logcumsumexp`` are lowered in ``reductions.py``.
"""

from __future__ import annotations

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten
Value = ir.Value


def _cumulative_extreme(x: Value, dim: int, is_max: bool) -> tuple[Value, Value]:
    dtype = builder.dtype_of(x)
    indices = builder.iota(builder.shape_of(x), torch.int64, dim)
    floating = dtype.is_floating_point

    def combine(acc, el):
        (a, ia), (b, ib) = acc, el
        if dtype is torch.bool:
            better = hlo.and_(a, hlo.not_(b)) if is_max else hlo.and_(b, hlo.not_(a))
            equal = builder.compare(a, b, "EQ")
        else:
            better = builder.compare(a, b, "GT" if is_max else "LT")
            equal = builder.compare(a, b, "EQ")
        if floating:
            a_nan, b_nan = builder.is_nan(a), builder.is_nan(b)
            better = hlo.or_(hlo.and_(a_nan, hlo.not_(b_nan)), hlo.and_(better, hlo.not_(b_nan)))
            equal = hlo.or_(equal, hlo.and_(a_nan, b_nan))
        pick_a = hlo.or_(better, hlo.and_(equal, builder.compare(ia, ib, "GT")))
        return [builder.select(pick_a, a, b), builder.select(pick_a, ia, ib)]

    worst = builder.min_value(dtype) if is_max else builder.max_value(dtype)
    identities = [builder.constant(worst, dtype, ()), builder.constant(-1, torch.int64, ())]
    values, positions = builder.scan([x, indices], identities, dim, combine)
    return values, positions


def _extreme_rule(ctx, x, dim, is_max):
    if builder.rank_of(x) == 0:
        return x, builder.constant(0, torch.int64, ())
    return _cumulative_extreme(x, dim % builder.rank_of(x), is_max)


@register_rule(aten.cummax.default)
def _cummax(ctx, x, dim):
    return _extreme_rule(ctx, x, dim, True)


@register_rule(aten.cummin.default)
def _cummin(ctx, x, dim):
    return _extreme_rule(ctx, x, dim, False)
