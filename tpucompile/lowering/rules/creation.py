"""Tensors created from nothing: full, zeros/ones-likes, arange/iota, scalar_tensor, empty."""

from __future__ import annotations

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten
prims = torch.ops.prims


@register_rule(aten.full.default)
def _full(ctx, size, fill_value, **kwargs):
    return ctx.scalar(1, fill_value, ctx.aval_out.dtype, ctx.aval_out.shape)


@register_rule(aten.full_like.default)
def _full_like(ctx, like, fill_value, **kwargs):
    return ctx.scalar(1, fill_value, ctx.aval_out.dtype, ctx.aval_out.shape)


@register_rule(aten.scalar_tensor.default)
def _scalar_tensor(ctx, value, **kwargs):
    return ctx.scalar(0, value, ctx.aval_out.dtype, ())


@register_rule(
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.empty_permuted.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.zeros.default, aten.zeros_like.default,
    aten.new_zeros.default, aten._efficientzerotensor.default,
)
def _zeros(ctx, *args, **kwargs):
    """Uninitialised memory has no meaning in a value program: empty tensors are zeros. (Autograd's
    ``_efficientzerotensor``, a gradient known to be zero, is zeros too.)"""
    return builder.constant(0, ctx.aval_out.dtype, ctx.aval_out.shape)


@register_rule(aten.ones.default, aten.ones_like.default)
def _ones(ctx, *args, **kwargs):
    return builder.constant(1, ctx.aval_out.dtype, ctx.aval_out.shape)


def _arange(ctx, start, step, start_position: int | None, step_position: int | None = None):
    """``start + i * step``; a start or step computed from runtime sizes (positions after a cache's length)
    is taken when the program runs."""
    spec = ctx.aval_out
    dtype = spec.dtype
    # Integers count exactly; floats are computed as start + i * step in (at least) f32, then rounded.
    compute = dtype if not dtype.is_floating_point or dtype.itemsize >= 4 else torch.float32
    index = builder.iota(spec.shape, compute, 0)
    first = (ctx.scalar(start_position, start, compute, spec.shape) if start_position is not None
             else builder.constant(start, compute, spec.shape))
    stride = (ctx.scalar(step_position, step, compute, spec.shape) if step_position is not None
              else builder.constant(step, compute, spec.shape))
    return builder.convert(hlo.add(first, hlo.multiply(index, stride)), dtype)


@register_rule(aten.arange.default)
def _arange_end(ctx, end, **kwargs):
    return _arange(ctx, 0, 1, start_position=None)


@register_rule(aten.arange.start)
def _arange_start(ctx, start, end, **kwargs):
    return _arange(ctx, start, 1, start_position=0)


@register_rule(aten.arange.start_step)
def _arange_start_step(ctx, start, end, step=1, **kwargs):
    return _arange(ctx, start, step, start_position=0, step_position=2)


@register_rule(prims.iota.default)
def _iota(ctx, length, *, start, step, **kwargs):
    return _arange(ctx, start, step, start_position=None)
