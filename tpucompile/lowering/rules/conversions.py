"""Casts and copies. In a functional graph a copy is the same value, so clones and aliases lower to nothing."""

from __future__ import annotations

import torch

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten
prims = torch.ops.prims


@register_rule(aten._to_copy.default, aten.to.dtype, prims.convert_element_type.default)
def _cast(ctx, x, *args, **kwargs):
    return builder.convert(x, ctx.aval_out.dtype)


@register_rule(
    aten.clone.default,
    aten.alias.default,
    aten.lift_fresh_copy.default,
    aten.detach.default,
    aten.contiguous.default,
)
def _identity(ctx, x, *args, **kwargs):
    return x


@register_rule(aten.copy.default)
def _copy(ctx, dst, src, non_blocking=False):
    """Functional ``copy``: ``src`` cast and broadcast into the shape and dtype of ``dst``."""
    return builder.broadcast_to(builder.convert(src, ctx.aval_out.dtype), ctx.aval_out.shape)
