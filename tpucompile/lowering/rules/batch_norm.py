"""Training-mode batch norm as the ``_batch_norm_with_update`` family reaches us, and ``batch_norm_backward``.

``_batch_norm_with_update_functional`` normalises over every dim but the channel dim (1) with the batch's
biased variance, returns the saved mean and inverse std for the backward, an empty uint8 ``reserve`` (the
cuDNN workspace, never used on this path) and the updated running stats (the running variance takes the
unbiased batch variance). ``batch_norm_backward`` is its derivative; with ``update=False`` (eval mode) the
running stats stand in for the batch's. bfloat16/float16 inputs are computed in float32.
"""

from __future__ import annotations

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten
Value = ir.Value


def _channel_sum(x: Value) -> Value:
    """Sum over every dim but 1: shape (C,)."""
    return builder.reduce_sum(x, [d for d in range(builder.rank_of(x)) if d != 1])


def _per_channel(v: Value, shape) -> Value:
    """A (C,) vector broadcast along dim 1 of ``shape``."""
    return builder.broadcast_in_dims(v, shape, [1])


def _param(value: Value | None, dtype: torch.dtype, channels: int, default: float) -> Value:
    if value is None:
        return builder.constant(default, dtype, (channels,))
    return builder.convert(value, dtype)


@register_rule(aten._batch_norm_with_update_functional.default)
def _batch_norm_with_update_functional(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    out_spec, mean_spec, invstd_spec, reserve_spec, rm_spec, rv_spec = ctx.avals_out
    shape = builder.shape_of(x)
    channels = shape[1]
    work = builder.accumulator_dtype(builder.dtype_of(x))
    x = builder.convert(x, work)
    count = builder.numel(s for d, s in enumerate(shape) if d != 1)
    mean = hlo.divide(_channel_sum(x), builder.constant(count, work, (channels,)))
    centred = hlo.subtract(x, _per_channel(mean, shape))
    var = hlo.divide(_channel_sum(hlo.multiply(centred, centred)), builder.constant(count, work, (channels,)))
    invstd = hlo.rsqrt(hlo.add(var, builder.constant(eps, work, (channels,))))
    scale = hlo.multiply(invstd, _param(weight, work, channels, 1.0))
    out = hlo.add(hlo.multiply(centred, _per_channel(scale, shape)),
                  _per_channel(_param(bias, work, channels, 0.0), shape))
    keep = builder.constant(1 - momentum, work, (channels,))
    step = builder.constant(momentum, work, (channels,))
    unbiased = hlo.divide(hlo.multiply(var, builder.constant(count, work, (channels,))),
                          builder.constant(count - 1, work, (channels,)))  # NaN for a single element, as eager
    new_mean = hlo.add(hlo.multiply(keep, builder.convert(running_mean, work)), hlo.multiply(step, mean))
    new_var = hlo.add(hlo.multiply(keep, builder.convert(running_var, work)), hlo.multiply(step, unbiased))
    return (
        builder.convert(out, out_spec.dtype),
        builder.convert(mean, mean_spec.dtype),
        builder.convert(invstd, invstd_spec.dtype),
        builder.constant(0, reserve_spec.dtype, reserve_spec.shape),
        builder.convert(new_mean, rm_spec.dtype),
        builder.convert(new_var, rv_spec.dtype),
    )


@register_rule(aten.batch_norm_backward.default)
def _batch_norm_backward(ctx, grad, x, weight, running_mean, running_var, save_mean, save_var, update, eps,
                         output_mask, reserve=None):
    """``save_var`` holds the saved inverse std (the name is ATen's)."""
    shape = builder.shape_of(x)
    channels = shape[1]
    work = builder.accumulator_dtype(builder.dtype_of(x))
    x, grad = builder.convert(x, work), builder.convert(grad, work)
    if update:
        mean, invstd = builder.convert(save_mean, work), builder.convert(save_var, work)
    else:
        mean = builder.convert(running_mean, work)
        var = builder.convert(running_var, work)
        invstd = hlo.rsqrt(hlo.add(var, builder.constant(eps, work, (channels,))))
    w = _param(weight, work, channels, 1.0)
    count = builder.numel(s for d, s in enumerate(shape) if d != 1)
    centred = hlo.subtract(x, _per_channel(mean, shape))
    grad_sum = _channel_sum(grad)
    dot = _channel_sum(hlo.multiply(grad, centred))
    if update:
        n = builder.constant(count, work, (channels,))
        grad_mean = hlo.divide(grad_sum, n)
        projection = hlo.divide(hlo.multiply(dot, hlo.multiply(invstd, invstd)), n)
        grad_input = hlo.subtract(
            hlo.subtract(grad, _per_channel(grad_mean, shape)),
            hlo.multiply(centred, _per_channel(projection, shape)),
        )
        grad_input = hlo.multiply(grad_input, _per_channel(hlo.multiply(invstd, w), shape))
    else:
        grad_input = hlo.multiply(grad, _per_channel(hlo.multiply(invstd, w), shape))
    results = [grad_input, hlo.multiply(dot, invstd), grad_sum]
    out = []
    for value, spec, wanted in zip(results, ctx.avals_out, output_mask, strict=True):
        if spec is None:
            out.append(None)
        elif wanted:
            out.append(builder.convert(value, spec.dtype))
        else:
            out.append(builder.constant(0, spec.dtype, spec.shape))
    return out
