"""CPU programs: depthwise convolutions written as a sum over the kernel's taps.

A depthwise convolution (one input feature per group, as many groups as features: MobileNet, ConvNeXt,
FastViT, EfficientNet) goes through a generic loop in XLA's CPU backend: a 3x3 one over 8 x 64 x 56 x 56
takes about 35 ms there against eager PyTorch's 0.5 ms, and FastViT-T8's training step ran 20 s against
eager's 0.5 s. Each of its output elements is the sum over the kernel's taps of one input element times one
weight, so the rewrite writes exactly that: per tap a strided slice of the padded input times the tap's
weights broadcast along the batch and the positions, all added up, which XLA fuses into one loop. The
input gradient of a depthwise convolution is one too (with an input dilation where the forward was
strided), and takes the same rewrite.

Like the host kernels' rewrites, this happens only when a program is compiled for this process's CPU (a TPU
runs grouped convolutions natively); the stored StableHLO keeps the convolution.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.runtime.mlir_walk import rewrite_each

MAX_TAPS = 81
"""Kernels of more taps (a 9x9 kernel has 81) stay convolutions: the sum grows with the taps."""


def _ints(op: Any, name: str, default: int, rank: int) -> list[int]:
    if name not in op.attributes:
        return [default] * rank
    return [int(v) for v in ir.DenseI64ArrayAttr(op.attributes[name])]


def _types(op: Any) -> list[Any] | None:
    """The types of the convolution's two operands and result, or None where the rewrite cannot take it: a
    shape known only at run time, or a reversed window."""
    types = [ir.RankedTensorType(v.type) for v in (*op.operands, op.results[0])]
    if not all(t.has_static_shape for t in types):
        return None
    if "window_reversal" in op.attributes and any(ir.DenseBoolArrayAttr(op.attributes["window_reversal"])):
        return None
    return types


def _padding(op: Any, rank: int) -> list[list[int]]:
    """(low, high) per spatial dimension."""
    if "padding" not in op.attributes:
        return [[0, 0]] * rank
    flat = [int(v) for v in ir.DenseIntElementsAttr(op.attributes["padding"])]
    return [flat[2 * i:2 * i + 2] for i in range(rank)]


def _pad(value: Any, low: list[int], high: list[int], interior: list[int]) -> Any:
    """``value`` padded with zeros (unchanged where nothing is added)."""
    if not any(low) and not any(high) and not any(interior):
        return value
    element = ir.RankedTensorType(value.type).element_type
    zero = hlo.constant(ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([], element), _zero(element)))
    return hlo.pad(value, zero, low, high, interior)


def _replace(op: Any) -> bool:
    """Rewrite one depthwise ``stablehlo.convolution``, forward (or input gradient) or kernel gradient;
    returns whether it did."""
    if int(ir.IntegerAttr(op.attributes["batch_group_count"]).value) != 1:
        return _replace_kernel_gradient(op)
    return _replace_forward(op)


def _replace_forward(op: Any) -> bool:
    """Rewrite one ``stablehlo.convolution`` if it is depthwise (one input feature per group, as many groups
    as features, any whole number of output features per group); returns whether it did."""
    lhs, rhs = op.operands
    types = _types(op)
    if types is None:
        return False
    lhs_type, rhs_type, out_type = types
    numbers = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    spatial = list(numbers.input_spatial_dimensions)
    same_layout = (numbers.output_batch_dimension == numbers.input_batch_dimension
                   and numbers.output_feature_dimension == numbers.input_feature_dimension
                   and list(numbers.output_spatial_dimensions) == spatial)
    lhs_shape, rhs_shape = list(lhs_type.shape), list(rhs_type.shape)
    features = lhs_shape[numbers.input_feature_dimension]
    groups = int(ir.IntegerAttr(op.attributes["feature_group_count"]).value)
    if not same_layout or features < 2 or groups != features:
        return False
    outputs = rhs_shape[numbers.kernel_output_feature_dimension]
    if rhs_shape[numbers.kernel_input_feature_dimension] != 1 or outputs % features:
        return False
    rank = len(spatial)
    kernel_spatial = list(numbers.kernel_spatial_dimensions)
    taps = [rhs_shape[d] for d in kernel_spatial]
    if math.prod(taps) > MAX_TAPS:
        return False
    strides = _ints(op, "window_strides", 1, rank)
    dilation = _ints(op, "rhs_dilation", 1, rank)
    padding = _padding(op, rank)
    input_dilation = _ints(op, "lhs_dilation", 1, rank)
    with ir.InsertionPoint(op), op.location:
        if outputs > features:  # m outputs per input feature: each input feature repeated m times, in order
            lhs = _repeat_features(lhs, numbers.input_feature_dimension, outputs // features)
        total = _tap_sum(lhs, rhs, numbers, out_type, taps, strides, dilation, padding, input_dilation)
        op.results[0].replace_all_uses_with(total)
    op.erase()
    return True


def _tap_sum(lhs: Any, rhs: Any, numbers: Any, out_type: Any, taps: list[int], strides: list[int],
             dilation: list[int], padding: list[list[int]], input_dilation: list[int]) -> Any:
    """The depthwise convolution as ``sum over taps t of slice_t(pad(lhs)) * rhs[:, 0, t]``, in the result's
    element type; an input dilation (a transposed convolution: the input gradient of a strided one) is the
    pad's interior padding, as the convolution dilates its input before padding it."""
    element = out_type.element_type
    rank_all = out_type.rank
    spatial = list(numbers.input_spatial_dimensions)
    feature = numbers.input_feature_dimension
    low, high, interior = [0] * rank_all, [0] * rank_all, [0] * rank_all
    for position, dim in enumerate(spatial):
        low[dim], high[dim] = padding[position]
        interior[dim] = input_dilation[position] - 1
    padded = _pad(_as(lhs, element), low, high, interior)
    out_shape = list(out_type.shape)
    weights = _as(rhs, element)
    features = out_shape[feature]
    counts = [out_shape[dim] for dim in spatial]
    total = None
    for tap in _taps(taps):
        window = _window(padded, spatial, tap, dilation, counts, strides)
        weight = _tap_weights(weights, numbers, tap, features, element)
        term = hlo.multiply(window, hlo.broadcast_in_dim(out_type, weight, [feature]))
        total = term if total is None else hlo.add(total, term)
    return total


def _repeat_features(value: Any, feature: int, times: int) -> Any:
    """``value`` with each feature repeated ``times`` times in place (feature ``c`` becomes ``c * times`` to
    ``c * times + times - 1``): output feature ``o`` of a depthwise convolution with ``times`` outputs per
    group reads input feature ``o // times``."""
    value_type = ir.RankedTensorType(value.type)
    shape = list(value_type.shape)
    spread = [*shape[:feature + 1], times, *shape[feature + 1:]]
    dims = [d if d <= feature else d + 1 for d in range(len(shape))]
    wide = hlo.broadcast_in_dim(ir.RankedTensorType.get(spread, value_type.element_type), value, dims)
    shape[feature] *= times
    return hlo.reshape(ir.RankedTensorType.get(shape, value_type.element_type), wide)


def _tap_weights(weights: Any, numbers: Any, tap: tuple[int, ...], features: int, element: Any) -> Any:
    """The kernel's weights at ``tap``, one per feature, as a 1-D tensor."""
    shape = list(ir.RankedTensorType(weights.type).shape)
    starts, limits = [0] * len(shape), list(shape)
    for position, dim in enumerate(numbers.kernel_spatial_dimensions):
        starts[dim], limits[dim] = tap[position], tap[position] + 1
    picked = hlo.slice(weights, starts, limits, [1] * len(shape))
    return hlo.reshape(ir.RankedTensorType.get([features], element), picked)


def _taps(taps: list[int]) -> list[tuple[int, ...]]:
    found: list[tuple[int, ...]] = [()]
    for size in taps:
        found = [(*prefix, index) for prefix in found for index in range(size)]
    return found


def _as(value: Any, element: Any) -> Any:
    """``value`` in element type ``element`` (the convolution's result type: bf16 operands accumulate in f32)."""
    value_type = ir.RankedTensorType(value.type)
    if value_type.element_type == element:
        return value
    return hlo.convert(ir.RankedTensorType.get(value_type.shape, element), value)


def _window(padded: Any, spatial: list[int], tap: tuple[int, ...], spacing: list[int], counts: list[int],
            stride: list[int]) -> Any:
    """The elements of ``padded`` that tap ``tap`` meets: along each spatial dimension ``counts`` of them,
    ``stride`` apart, from ``tap * spacing``; every other dimension whole."""
    shape = list(ir.RankedTensorType(padded.type).shape)
    starts, limits, steps = [0] * len(shape), list(shape), [1] * len(shape)
    for position, dim in enumerate(spatial):
        starts[dim] = tap[position] * spacing[position]
        limits[dim] = starts[dim] + (counts[position] - 1) * stride[position] + 1
        steps[dim] = stride[position]
    return hlo.slice(padded, starts, limits, steps)


def _zero(element: Any) -> Any:
    return ir.IntegerAttr.get(element, 0) if "i" in str(element) else ir.FloatAttr.get(element, 0.0)


def _replace_kernel_gradient(op: Any) -> bool:
    """The kernel gradient of a depthwise convolution, as the lowering writes it (``_weight_grad``: the input
    ``x [N, C, *S]`` with batch and feature roles swapped, the output gradient ``gy [N, O, *P]`` as the
    kernel, ``batch_group_count = C``, the forward's dilation as window strides and its stride as the kernel
    dilation; result ``[O, 1, *K]``): per tap ``t``, ``sum over n, p of x_pad[n, o // m, t * d + p * s] *
    gy[n, o, p]``, one batched product per tap. XLA's CPU backend turns the grouped form into a convolution
    whose window spans the features (FastViT-T8's last block: 3 s against eager's 11 ms)."""
    x, gy = op.operands
    types = _types(op)
    if types is None or int(ir.IntegerAttr(op.attributes["feature_group_count"]).value) != 1:
        return False
    x_type, gy_type, out_type = types
    numbers = hlo.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    rank = x_type.rank - 2
    spatial = list(range(2, rank + 2))
    roles = (numbers.input_batch_dimension, numbers.input_feature_dimension, numbers.kernel_input_feature_dimension,
             numbers.kernel_output_feature_dimension, numbers.output_batch_dimension, numbers.output_feature_dimension)
    layouts = (list(numbers.input_spatial_dimensions), list(numbers.kernel_spatial_dimensions),
               list(numbers.output_spatial_dimensions))
    if roles != (1, 0, 0, 1, 1, 0) or any(dims != spatial for dims in layouts):
        return False
    x_shape, gy_shape, out_shape = list(x_type.shape), list(gy_type.shape), list(out_type.shape)
    features, outputs = x_shape[1], gy_shape[1]
    groups = int(ir.IntegerAttr(op.attributes["batch_group_count"]).value)
    if groups != features or features < 2 or outputs % features or out_shape[:2] != [outputs, 1]:
        return False
    if _ints(op, "lhs_dilation", 1, rank) != [1] * rank:
        return False
    taps = out_shape[2:]
    if math.prod(taps) > MAX_TAPS:
        return False
    tap_step = _ints(op, "window_strides", 1, rank)  # the forward's dilation
    position_step = _ints(op, "rhs_dilation", 1, rank)  # the forward's stride
    padding = _padding(op, rank)
    element = out_type.element_type
    with ir.InsertionPoint(op), op.location:
        x, gy = _as(x, element), _as(gy, element)
        if outputs > features:
            x = _repeat_features(x, 1, outputs // features)
        padded = _pad(x, [0, 0, *(p[0] for p in padding)], [0, 0, *(p[1] for p in padding)], [0] * x_type.rank)
        positions = gy_shape[2:]
        per_tap = []
        vector = ir.RankedTensorType.get([1, outputs], element)
        contracting = [0, *spatial]  # images and positions; the features are the batch
        numbers_dot = hlo.DotDimensionNumbers.get(lhs_batching_dimensions=[1], rhs_batching_dimensions=[1],
                                                  lhs_contracting_dimensions=contracting,
                                                  rhs_contracting_dimensions=contracting)
        for tap in _taps(taps):
            window = _window(padded, spatial, tap, tap_step, positions, position_step)
            summed = hlo.dot_general(ir.RankedTensorType.get([outputs], element), window, gy, numbers_dot)
            per_tap.append(hlo.reshape(vector, summed))
        stacked = hlo.concatenate(per_tap, 0) if len(per_tap) > 1 else per_tap[0]  # [taps, O]
        by_tap = hlo.reshape(ir.RankedTensorType.get([*taps, outputs], element), stacked)
        moved = hlo.transpose(by_tap, [rank, *range(rank)])  # [O, *K]
        result = hlo.reshape(out_type, moved)
        op.results[0].replace_all_uses_with(result)
    op.erase()
    return True


REPLACEMENTS: dict[str, Callable[[Any], bool]] = {"stablehlo.convolution": _replace}


def rewrite(module: bytes | str) -> bytes | str:
    """``module`` with its depthwise convolutions written as sums over their taps (unchanged, the same
    object, when it has none)."""
    return rewrite_each(module, REPLACEMENTS)
