"""CPU programs: f32 2-D ``stablehlo.convolution`` → a call of the host im2col/col2im + BLAS kernel
(``tpucompile_host_conv``).

This module says which convolutions the kernel *can* take and rewrites one; ``kernel_choice`` decides, by
timing each against XLA's own convolution, which of them it *does* take. The lowering
(``lowering/rules/convolution.py``) emits three forms of convolution, one kernel mode each:

* mode 0, the forward form: input ``[B, C, H, W]``, kernel ``[O, C, KH, KW]`` or ``[C, O, KH, KW]``, result
  ``[B, O, OH, OW]``, with strides, padding and kernel dilation: im2col, then one product per image;
* mode 1, the kernel gradient: input ``x`` with batch and feature roles swapped, the output gradient as the
  kernel, the original stride as the kernel dilation and the original dilation as the window stride,
  computed as ATen does: the output gradient times the forward's im2col, summed over images;
* mode 2, the forward form with an input dilation and unit window strides: a transposed convolution, which is
  also the input gradient of a strided one. One product per image (small images stacked into one) followed
  by col2im, so none of the zeros the dilated input would hold is multiplied.

Modes 0 and 1 are taken only where their outputs have ``_MIN_POSITIONS`` positions per image or more; mode 2
at every size. Grouped convolutions, other ranks, other dtypes and other dimension orders stay with XLA. Like
``dots``, the rewrite happens only when a program is compiled for this process's CPU; the stored
StableHLO program is not touched.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.runtime.host_kernels.ffi_calls import ffi_call
from tpucompile.runtime.host_kernels.library import CONV_TARGET_NAME

_INT32_MAX = 2**31 - 1
_MIN_POSITIONS = 256
"""Forward convolutions and kernel gradients whose output (or output gradient) has fewer positions per image
stay with XLA, which is faster there: their im2col copies rows of a few elements each. Transposed convolutions
are taken at every size (col2im skips the dilated zeros XLA multiplies)."""
_MIN_PRODUCT_WIDTH = 256
"""Images go side by side into one product until it is this many positions wide: thinner products run far
below the BLAS's peak."""
_MAX_SCRATCH_FLOATS = 1 << 26
"""Convolutions whose workspace would exceed this (256 MiB) stay with XLA: im2col of large images with many
channels is large (a 224x224 3x3 convolution of 64 channels: 115 MB per image)."""


def _ints(op: Any, name: str, default: int) -> list[int]:
    if name not in op.attributes:
        return [default, default]
    return [int(v) for v in ir.DenseI64ArrayAttr(op.attributes[name])]


def _replace(op: Any) -> bool:
    lhs, rhs = op.operands
    types = [ir.RankedTensorType(v.type) for v in (lhs, rhs, op.results[0])]
    if not all(t.has_static_shape and t.rank == 4 and str(t.element_type) == "f32" for t in types):
        return False
    if int(ir.IntegerAttr(op.attributes["feature_group_count"]).value) != 1:
        return False
    if int(ir.IntegerAttr(op.attributes["batch_group_count"]).value) != 1:
        return False
    if "window_reversal" in op.attributes and any(ir.DenseBoolArrayAttr(op.attributes["window_reversal"])):
        return False
    numbers = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    spatial = (list(numbers.input_spatial_dimensions), list(numbers.kernel_spatial_dimensions),
               list(numbers.output_spatial_dimensions))
    if any(dims != [2, 3] for dims in spatial):
        return False
    roles = (numbers.input_batch_dimension, numbers.input_feature_dimension,
             numbers.kernel_input_feature_dimension, numbers.kernel_output_feature_dimension,
             numbers.output_batch_dimension, numbers.output_feature_dimension)
    strides = _ints(op, "window_strides", 1)
    lhs_dilation = _ints(op, "lhs_dilation", 1)
    rhs_dilation = _ints(op, "rhs_dilation", 1)
    padding = [[0, 0], [0, 0]]
    if "padding" in op.attributes:
        flat = [int(v) for v in ir.DenseIntElementsAttr(op.attributes["padding"])]
        padding = [flat[0:2], flat[2:4]]
    lhs_shape, rhs_shape, out_shape = (list(t.shape) for t in types)
    forward_form = roles in ((0, 1, 1, 0, 0, 1), (0, 1, 0, 1, 0, 1))
    kernel_io = roles[2] == 0  # forward form: the kernel's input features lead
    if forward_form and lhs_dilation == [1, 1]:
        mode, images, positions, kernel_taps = 0, lhs_shape, out_shape, rhs_shape[2:]
        forward = dict(stride=strides, pad=[p[0] for p in padding], rhs_dilation=rhs_dilation)
    elif forward_form and strides == [1, 1]:
        # A transposed convolution (the input gradient of a strided one). The forward convolution it
        # transposes has stride = lhs_dilation and low padding = dilation * (taps - 1) - this padding.
        mode, images, positions, kernel_taps = 2, out_shape, lhs_shape, rhs_shape[2:]
        pad = [d * (k - 1) - p[0] for d, k, p in zip(rhs_dilation, kernel_taps, padding, strict=True)]
        forward = dict(stride=lhs_dilation, pad=pad, rhs_dilation=rhs_dilation)
        lhs_dilation = [1, 1]
    elif roles == (1, 0, 0, 1, 1, 0) and lhs_dilation == [1, 1]:
        # The kernel gradient of a forward convolution: the window stride here is the forward's dilation,
        # the kernel dilation the forward's stride.
        mode, images, positions, kernel_taps = 1, lhs_shape, rhs_shape, out_shape[2:]
        forward = dict(stride=rhs_dilation, pad=[p[0] for p in padding], rhs_dilation=strides)
        kernel_io = False
    else:
        return False
    batch, channels, features = images[0], images[1], positions[1]
    rows = channels * kernel_taps[0] * kernel_taps[1]
    places = positions[2] * positions[3]
    if 0 in (batch, rows, places, features) or (mode != 2 and places < _MIN_POSITIONS):
        return False
    group = min(batch, -(-_MIN_PRODUCT_WIDTH // places))
    columns = group * places
    slot = rows * columns + features * columns + (features * rows if mode == 1 else 0)
    shared = features * rows if mode == 2 or (mode == 0 and kernel_io) else 0
    if max(rows, columns, features, slot) > _INT32_MAX:
        return False
    scratch = slot * min(-(-batch // group), _workers()) + shared
    if scratch > _MAX_SCRATCH_FLOATS:
        return False
    attributes = dict(mode=mode, kernel_io=int(kernel_io), group=group)
    for name, pair in (*forward.items(), ("lhs_dilation", lhs_dilation)):
        attributes[f"{name}_h"], attributes[f"{name}_w"] = pair
    scratch_type = ir.RankedTensorType.get([max(scratch, 1)], ir.F32Type.get())
    with ir.InsertionPoint(op), op.location:
        call = ffi_call(CONV_TARGET_NAME, [types[2], scratch_type], [lhs, rhs], attributes)
    op.results[0].replace_all_uses_with(call.results[0])
    op.erase()
    return True


CONVOLUTION_REPLACEMENTS: dict[str, Callable[[Any], bool]] = {"stablehlo.convolution": _replace}
"""What ``mlir_walk.rewrite_each`` calls to rewrite the convolutions (``kernel_choice`` combines it with the
other rewrites)."""


@functools.cache
def _workers() -> int:
    """How many threads may share a convolution's images: the cores XLA's CPU pool is sized to (at most the
    kernel's ``MAX_CONV_WORKERS``). Cached: the pool is sized once, when the client starts."""
    try:
        return max(1, min(len(os.sched_getaffinity(0)), 64))
    except AttributeError:
        return max(1, min(os.cpu_count() or 1, 64))
