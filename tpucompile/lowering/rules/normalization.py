"""Softmax (and its backward) and layer norm, lowered whole so that XLA sees one max/sum reduction pair and
one fusion; and weight norm's backward, which PyTorch has no decomposition for.

Low-precision inputs are normalised in f32 and rounded once. (Eager's CPU softmax also rounds exp() to
bf16/f16 before normalising, so results may differ from it by an ulp, ours being the closer to exact.)"""

from __future__ import annotations

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder, dynamic_sizes
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten


def _reduce_keep(x, dim, combine, init):
    shape = builder.shape_of(x)
    reduced = builder.reduce([x], [builder.constant(init, builder.dtype_of(x), ())], [dim],
                             lambda acc, el: [combine(acc[0], el[0])])[0]
    kept = [1 if i == dim else s for i, s in enumerate(shape)]
    return builder.broadcast_to(builder.reshape(reduced, kept), shape)


def _over_dim(ctx, x, dim, body):
    """Apply ``body(x, dim)`` in the compute dtype; a 0-d tensor is treated as a 1-element vector."""
    x = builder.convert(x, builder.accumulator_dtype(ctx.aval_out.dtype))
    if builder.rank_of(x) == 0:
        return builder.convert(builder.reshape(body(builder.reshape(x, (1,)), 0), ()), ctx.aval_out.dtype)
    return builder.convert(body(x, dim % builder.rank_of(x)), ctx.aval_out.dtype)


def _shifted(x, dim):
    # An all -inf row gives -inf - -inf = NaN; torch gives NaN too, so no special case is needed.
    return hlo.subtract(x, _reduce_keep(x, dim, hlo.maximum, float("-inf")))


@register_rule(aten._softmax.default)
def _softmax(ctx, x, dim, half_to_float=False):
    def body(x, dim):
        exp = hlo.exponential(_shifted(x, dim))
        return hlo.divide(exp, _reduce_keep(exp, dim, hlo.add, 0))

    return _over_dim(ctx, x, dim, body)


@register_rule(aten._log_softmax.default)
def _log_softmax(ctx, x, dim, half_to_float=False):
    def body(x, dim):
        shifted = _shifted(x, dim)
        return hlo.subtract(shifted, hlo.log(_reduce_keep(hlo.exponential(shifted), dim, hlo.add, 0)))

    return _over_dim(ctx, x, dim, body)


@register_rule(aten.native_layer_norm.default)
def _native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    """Returns (output, mean, rstd) with mean/rstd shaped like x with the normalised dims kept as 1."""
    out_dtype = ctx.avals_out[0].dtype
    compute = builder.accumulator_dtype(out_dtype)
    x = builder.convert(x, compute)
    shape = builder.shape_of(x)
    axis = len(shape) - len(normalized_shape)
    dims = list(range(axis, len(shape)))
    count = _normalised_count(ctx, shape, dims, compute)
    stat_shape = shape[:axis] + (1,) * len(dims)

    def mean_of(value):
        total = builder.reduce_sum(value, dims)
        mean = hlo.divide(total, builder.broadcast_to(count, builder.shape_of(total)))
        return builder.reshape(mean, stat_shape)

    mean = mean_of(x)
    centered = hlo.subtract(x, builder.broadcast_to(mean, shape))
    var = mean_of(hlo.multiply(centered, centered))
    rstd = hlo.rsqrt(hlo.add(var, builder.constant(eps, compute, stat_shape)))
    out = hlo.multiply(centered, builder.broadcast_to(rstd, shape))
    if weight is not None:
        out = hlo.multiply(out, builder.broadcast_to(builder.convert(weight, compute), shape))
    if bias is not None:
        out = hlo.add(out, builder.broadcast_to(builder.convert(bias, compute), shape))
    stats_dtype = ctx.avals_out[1].dtype
    return (
        builder.convert(out, out_dtype),
        builder.convert(mean, stats_dtype),
        builder.convert(rstd, stats_dtype),
    )


def _normalised_count(ctx, shape, dims, dtype):
    """How many elements each normalised group holds, as a scalar of ``dtype``: in a bucketed program that
    pads a normalised dimension, its actual extent counts (XLA's dynamic padder leaves the padding out of the
    sums), not the bucket's."""
    count = dynamic_sizes.element_count(ctx.extent, ctx.operand_metas[0], shape, dims)
    return builder.constant(count, dtype, ()) if isinstance(count, int) else builder.convert(count, dtype)


@register_rule(aten._softmax_backward_data.default)
def _softmax_backward_data(ctx, grad, output, dim, input_dtype):
    """``output * (grad - sum(grad * output))`` along ``dim``, in f32 for low-precision inputs."""
    compute = builder.accumulator_dtype(ctx.aval_out.dtype)
    output = builder.convert(output, compute)
    if builder.rank_of(output) == 0:
        output = builder.reshape(output, (1,))

    def body(grad, dim):
        return hlo.multiply(output, hlo.subtract(grad, _reduce_keep(hlo.multiply(grad, output), dim, hlo.add, 0)))

    return _over_dim(ctx, grad, dim, body)


@register_rule(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(ctx, grad, output, dim, input_dtype):
    """``grad - exp(output) * sum(grad)`` along ``dim``, in f32 for low-precision inputs."""
    compute = builder.accumulator_dtype(ctx.aval_out.dtype)
    output = builder.convert(output, compute)
    if builder.rank_of(output) == 0:
        output = builder.reshape(output, (1,))

    def body(grad, dim):
        return hlo.subtract(grad, hlo.multiply(hlo.exponential(output), _reduce_keep(grad, dim, hlo.add, 0)))

    return _over_dim(ctx, grad, dim, body)


@register_rule(aten._weight_norm_interface_backward.default)
def _weight_norm_interface_backward(ctx, grad_w, v, g, norm, dim):
    """The gradient of ``w = v * (g / norm)``, ``norm`` being ``||v||`` over every dim but ``dim``:
    ``grad_g = sum(grad_w * v) / norm`` and ``grad_v = (g / norm) * (grad_w - v * grad_g / norm)``, sums over
    the same dims. Autograd asks for it when the fused forward (``torch._weight_norm`` with ``dim`` first or
    last) ran, whose table decomposition saves ``norm``; a ``dim`` outside ``[0, rank)`` means the whole
    tensor, as in that decomposition. Low-precision tensors are computed in f32 (where ``norm`` already is)."""
    grad_v_spec, grad_g_spec = ctx.avals_out
    compute = builder.accumulator_dtype(grad_v_spec.dtype)
    shape = builder.shape_of(v)
    dims = [d for d in range(len(shape)) if d != dim]
    kept = [1 if d in dims else s for d, s in enumerate(shape)]  # g and norm: one value per slice along dim

    def spread(value):
        return builder.broadcast_to(value, shape)

    grad_w, v = builder.convert(grad_w, compute), builder.convert(v, compute)
    g, norm = (builder.reshape(builder.convert(t, compute), kept) for t in (g, norm))
    grad_g = hlo.divide(builder.reshape(builder.reduce_sum(hlo.multiply(grad_w, v), dims), kept), norm)
    grad_v = hlo.multiply(spread(hlo.divide(g, norm)),
                          hlo.subtract(grad_w, hlo.multiply(v, spread(hlo.divide(grad_g, norm)))))
    return (
        builder.convert(grad_v, grad_v_spec.dtype),
        builder.reshape(builder.convert(grad_g, grad_g_spec.dtype), grad_g_spec.shape),
    )
