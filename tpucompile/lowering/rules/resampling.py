"""Resampling and edge padding that survive AOTAutograd's decomposition table.

Most of this family never reaches the backend: ``F.interpolate`` in nearest / (bi,tri)linear / bicubic modes
and reflect / replicate padding are decomposed into ``arange``, ``index``, ``index_put`` and arithmetic, which
other rule modules lower, and reflection padding's backward is decomposed too. What arrives is:

* ``replication_pad{1,2,3}d_backward``: each input element gathers the gradient of every output element
  that copies it (output ``j`` copies input ``clamp(j - pad_low, 0, size - 1)``, negative pads included):
  slices, sums and pads, one padded dim at a time;
* ``_upsample_{bilinear,bicubic}2d_aa`` (``antialias=True``) and their backward: separable linear maps whose
  weights depend only on static sizes, so one constant ``(out, in)`` matrix per spatial dim, applied with
  ``builder.contract_trailing`` (the backward applies the transposed matrices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.contracts.resize_scale import source_scale
from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten
Value = ir.Value


# --- replication padding ----------------------------------------------------------------------------------


def _pad_dim(x: Value, dim: int, low: int, high: int) -> Value:
    rank = builder.rank_of(x)
    lows, highs = [0] * rank, [0] * rank
    lows[dim], highs[dim] = low, high
    return hlo.pad(x, builder.constant(0, builder.dtype_of(x)), lows, highs, [0] * rank)


def _replication_grad_dim(grad: Value, dim: int, size: int, low: int) -> Value:
    """Fold the gradient of one replication-padded dim (``grad``'s ``dim``, output j copying input
    ``clamp(j - low, 0, size - 1)``) back onto its ``size`` inputs: the copied middle moves into place, the
    outputs left of it add to input 0, those right of it to input ``size - 1``."""
    out = builder.shape_of(grad)[dim]
    start, stop = max(low, 0), min(low + size, out)  # outputs that copy input j - low one to one
    parts = []
    if stop > start:
        parts.append(_pad_dim(builder.slice_along(grad, dim, start, stop), dim, start - low, size - (stop - low)))
    for first, last, target in ((0, min(low, out), 0), (max(low + size, 0), out, size - 1)):
        if last > first:
            edge = _sum_keepdim(builder.slice_along(grad, dim, first, last), dim)
            parts.append(_pad_dim(edge, dim, target, size - 1 - target))
    if not parts:
        shape = list(builder.shape_of(grad))
        shape[dim] = size
        return builder.constant(0, builder.dtype_of(grad), shape)
    total = parts[0]
    for part in parts[1:]:
        total = hlo.add(total, part)
    return total


def _sum_keepdim(x: Value, dim: int) -> Value:
    total = builder.reduce_sum(x, [dim])
    shape = list(builder.shape_of(x))
    shape[dim] = 1
    return builder.reshape(total, shape)


@register_rule(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def _replication_pad_backward(ctx, grad, x, padding):
    nd = len(padding) // 2
    in_shape, dtype = ctx.aval_out.shape, ctx.aval_out.dtype
    rank = len(in_shape)
    result = builder.convert(grad, builder.accumulator_dtype(dtype))
    for i in range(nd):  # ``padding`` lists (low, high) pairs starting from the last dim
        dim = rank - 1 - i
        result = _replication_grad_dim(result, dim, in_shape[dim], padding[2 * i])
    return builder.convert(result, dtype)


# --- anti-aliased interpolation ---------------------------------------------------------------------------


def _triangle(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _cubic(x: float, a: float = -0.5) -> float:
    """The cubic convolution kernel with a = -0.5 (the anti-aliased bicubic mode's, as in PIL)."""
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return 0.0


def _antialias_matrix(
    size: int, out: int, align_corners: bool, scale_factor: float | None, filter_fn: Callable[[float], float],
    support_radius: float,
) -> np.ndarray:
    """``(out, size)`` weights of anti-aliased interpolation along one dim: output i averages the inputs
    within ``support`` of its centre ``scale (i + 0.5)``, weighted by the filter stretched by the scale when
    downsampling, normalised to sum to 1."""
    scale = source_scale(size, out, align_corners, scale_factor)
    support = support_radius * scale if scale >= 1.0 else support_radius
    inverse = 1.0 / scale if scale >= 1.0 else 1.0
    matrix = np.zeros((out, size), dtype=np.float64)
    for i in range(out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size)
        weights = np.asarray([filter_fn((j - center + 0.5) * inverse) for j in range(lo, hi)], dtype=np.float64)
        total = weights.sum()
        if total != 0.0:
            weights = weights / total
        matrix[i, lo:hi] = weights
    return matrix.astype(np.float32)


_FILTERS = {
    aten._upsample_bilinear2d_aa.default: (_triangle, 1.0),
    aten._upsample_bilinear2d_aa_backward.default: (_triangle, 1.0),
    aten._upsample_bicubic2d_aa.default: (_cubic, 2.0),
    aten._upsample_bicubic2d_aa_backward.default: (_cubic, 2.0),
}


def _antialias_matrices(target, in_sizes: Sequence[int], out_sizes: Sequence[int], align_corners: bool,
                        scales: Sequence[float | None]) -> list[np.ndarray]:
    filter_fn, radius = _FILTERS[target]
    return [
        _antialias_matrix(size, out, align_corners, scale, filter_fn, radius)
        for size, out, scale in zip(in_sizes, out_sizes, scales, strict=True)
    ]


@register_rule(aten._upsample_bilinear2d_aa.default, aten._upsample_bicubic2d_aa.default)
def _upsample_aa(ctx, x, output_size, align_corners, scales_h=None, scales_w=None):
    dtype = ctx.aval_out.dtype
    in_sizes = builder.shape_of(x)[-2:]
    matrices = _antialias_matrices(ctx.node.target, in_sizes, ctx.aval_out.shape[-2:], align_corners,
                                   [scales_h, scales_w])
    result = builder.contract_trailing(builder.convert(x, builder.accumulator_dtype(dtype)), matrices)
    return builder.convert(result, dtype)


@register_rule(aten._upsample_bilinear2d_aa_backward.default, aten._upsample_bicubic2d_aa_backward.default)
def _upsample_aa_backward(ctx, grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    dtype = ctx.aval_out.dtype
    matrices = _antialias_matrices(ctx.node.target, ctx.aval_out.shape[-2:], builder.shape_of(grad)[-2:],
                                   align_corners, [scales_h, scales_w])
    result = builder.contract_trailing(builder.convert(grad, builder.accumulator_dtype(dtype)), [m.T for m in matrices])
    return builder.convert(result, dtype)
