"""Convolutions (1d/2d/3d, grouped, dilated, strided, transposed) and their backward, on ``stablehlo.convolution``.

Tensors keep PyTorch's layout: inputs ``(N, C, *spatial)``, kernels ``(O, C / groups, *K)`` (transposed:
``(C, O / groups, *K)``); dimension numbers tell XLA which dimension is which, so no transposes are needed
except to regroup a kernel. Three convolutions cover everything:

* ``_forward``: the ordinary convolution;
* ``_input_grad``: its gradient with respect to the input, which is also a transposed convolution: the
  operand is dilated by the stride (``lhs_dilation``), the kernel flipped and its in/out features swapped;
* ``_weight_grad``: its gradient with respect to the kernel: the input convolved with the output gradient,
  batch and feature roles swapped, the stride becoming the kernel's dilation and the dilation the stride;
  groups become a ``batch_group_count``.

A transposed convolution's own gradients are the ordinary ones with the roles of input and output exchanged.
bf16/f16 convolutions accumulate in f32 and round once, as the matmul rules do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import tensor_type

aten = torch.ops.aten
Value = ir.Value


def _convolution(
    lhs: Value,
    rhs: Value,
    out_shape: Sequence[int],
    out_dtype: torch.dtype,
    *,
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    feature_groups: int = 1,
    batch_groups: int = 1,
    lhs_dims: tuple[int, int] = (0, 1),
    kernel_dims: tuple[int, int] = (1, 0),
    out_dims: tuple[int, int] = (0, 1),
) -> Value:
    """``stablehlo.convolution`` on operands whose spatial dims are ``2..rank``.

    ``lhs_dims`` = (batch, feature) dims of ``lhs``; ``kernel_dims`` = (input feature, output feature) dims of
    ``rhs``; ``out_dims`` = (batch, feature) dims of the result. Padding pairs may be negative (a crop).
    """
    nd = builder.rank_of(lhs) - 2
    spatial = list(range(2, 2 + nd))
    numbers = hlo.ConvDimensionNumbers.get(
        input_batch_dimension=lhs_dims[0],
        input_feature_dimension=lhs_dims[1],
        input_spatial_dimensions=spatial,
        kernel_input_feature_dimension=kernel_dims[0],
        kernel_output_feature_dimension=kernel_dims[1],
        kernel_spatial_dimensions=spatial,
        output_batch_dimension=out_dims[0],
        output_feature_dimension=out_dims[1],
        output_spatial_dimensions=spatial,
    )
    return hlo.convolution(
        tensor_type(tuple(out_shape), out_dtype),
        lhs,
        rhs,
        numbers,
        feature_groups,
        batch_groups,
        window_strides=list(strides),
        padding=ir.DenseIntElementsAttr.get(np.asarray(padding, dtype=np.int64).reshape(nd, 2)),
        lhs_dilation=list(lhs_dilation or [1] * nd),
        rhs_dilation=list(rhs_dilation or [1] * nd),
    )


def _forward(x, w, stride, padding, dilation, groups, out_spatial, dtype) -> Value:
    """The ordinary convolution of ``x (N, C, *X)`` with ``w (O, C/g, *K)``; result ``(N, O, *out_spatial)``.

    The high padding is whatever yields exactly ``out_spatial`` (it drops trailing input that no window
    reaches, or pads further when a caller asks for a longer output)."""
    x_shape, w_shape = builder.shape_of(x), builder.shape_of(w)
    pads = []
    for size, k, s, p, d, out in zip(x_shape[2:], w_shape[2:], stride, padding, dilation, out_spatial, strict=True):
        pads.append((p, (out - 1) * s + d * (k - 1) + 1 - size - p))
    return _convolution(
        x, w, (x_shape[0], w_shape[0], *out_spatial), dtype,
        strides=stride, padding=pads, rhs_dilation=dilation, feature_groups=groups,
    )


def _swap_kernel(w: Value, groups: int) -> Value:
    """``(A, B, *K)`` with A = groups * A/g → ``(A/g, groups * B, *K)``, spatially flipped: the kernel of the
    transposed convolution (its input features first, its output features grouped group-major)."""
    shape = builder.shape_of(w)
    a, b, kernel = shape[0], shape[1], shape[2:]
    nd = len(kernel)
    if groups > 1:
        w = builder.reshape(w, (groups, a // groups, b, *kernel))
        w = builder.transpose(w, [1, 0, 2, *range(3, 3 + nd)])
        w = builder.reshape(w, (a // groups, groups * b, *kernel))
    return hlo.reverse(w, list(range(2, 2 + nd)))


def _input_grad(gy, w, stride, padding, dilation, groups, in_spatial, dtype) -> Value:
    """Gradient of ``_forward`` with respect to its input, given the output gradient ``gy (N, O, *Y)`` and
    ``w (O, C/g, *K)``; result ``(N, C, *in_spatial)``. Also the transposed convolution (with ``in_spatial``
    its output size, which output_padding lengthens)."""
    gy_shape, w_shape = builder.shape_of(gy), builder.shape_of(w)
    kernel = _swap_kernel(w, groups)
    pads = []
    for y, k, s, p, d, size in zip(gy_shape[2:], w_shape[2:], stride, padding, dilation, in_spatial, strict=True):
        lo = d * (k - 1) - p
        pads.append((lo, size + d * (k - 1) - ((y - 1) * s + 1) - lo))
    return _convolution(
        gy, kernel, (gy_shape[0], builder.shape_of(kernel)[1], *in_spatial), dtype,
        strides=[1] * len(pads), padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
        feature_groups=groups, kernel_dims=(0, 1),
    )


def _weight_grad(x, gy, stride, padding, dilation, groups, kernel_spatial, dtype) -> Value:
    """Gradient of ``_forward`` with respect to its kernel, from ``x (N, C, *X)`` and ``gy (N, O, *Y)``;
    result ``(O, C/g, *kernel_spatial)``."""
    x_shape, gy_shape = builder.shape_of(x), builder.shape_of(gy)
    pads = []
    for size, y, s, p, d, k in zip(x_shape[2:], gy_shape[2:], stride, padding, dilation, kernel_spatial, strict=True):
        pads.append((p, (k - 1) * d + (y - 1) * s + 1 - size - p))
    return _convolution(
        x, gy, (gy_shape[1], x_shape[1] // groups, *kernel_spatial), dtype,
        strides=dilation, padding=pads, rhs_dilation=stride, batch_groups=groups,
        lhs_dims=(1, 0), kernel_dims=(0, 1), out_dims=(1, 0),
    )


def _parameters(x, stride, padding, dilation, output_padding):
    nd = builder.rank_of(x) - 2
    return (builder.per_dim(stride, nd), builder.per_dim(padding, nd), builder.per_dim(dilation, nd),
            builder.per_dim(output_padding, nd))


@register_rule(aten.convolution.default)
def _convolution_rule(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    dtype = ctx.aval_out.dtype
    acc = builder.accumulator_dtype(dtype)
    stride, padding, dilation, _ = _parameters(x, stride, padding, dilation, output_padding)
    x, w = builder.convert(x, dtype), builder.convert(w, dtype)
    out_spatial = ctx.aval_out.shape[2:]
    if transposed:
        y = _input_grad(x, w, stride, padding, dilation, groups, out_spatial, acc)
    else:
        y = _forward(x, w, stride, padding, dilation, groups, out_spatial, acc)
    if bias is not None:
        bias = builder.convert(bias, acc)
        y = hlo.add(y, builder.broadcast_in_dims(bias, builder.shape_of(y), [1]))
    return builder.convert(y, dtype)


@register_rule(aten.convolution_backward.default)
def _convolution_backward(
    ctx, gy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    stride, padding, dilation, _ = _parameters(x, stride, padding, dilation, output_padding)
    dtype = builder.dtype_of(gy)
    acc = builder.accumulator_dtype(dtype)
    x, w = builder.convert(x, dtype), builder.convert(w, dtype)
    x_spatial = builder.shape_of(x)[2:]
    w_spatial = builder.shape_of(w)[2:]
    grads: list[Value | None] = [None, None, None]
    if output_mask[0]:
        if transposed:  # the transposed convolution is _input_grad(x, w): its input gradient is _forward
            grad = _forward(gy, w, stride, padding, dilation, groups, x_spatial, acc)
        else:
            grad = _input_grad(gy, w, stride, padding, dilation, groups, x_spatial, acc)
        grads[0] = grad
    if output_mask[1]:
        if transposed:  # the ordinary formula with the output (gy) in the input's role and x in gy's
            grad = _weight_grad(gy, x, stride, padding, dilation, groups, w_spatial, acc)
        else:
            grad = _weight_grad(x, gy, stride, padding, dilation, groups, w_spatial, acc)
        grads[1] = grad
    if output_mask[2]:
        dims = [d for d in range(builder.rank_of(gy)) if d != 1]
        grads[2] = builder.reduce_sum(builder.convert(gy, acc), dims)
    results = []
    for grad, spec in zip(grads, ctx.avals_out, strict=True):
        if grad is None or spec is None:
            results.append(None)
        else:
            results.append(builder.convert(builder.reshape(grad, spec.shape), spec.dtype))
    return results
