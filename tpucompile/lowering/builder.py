"""Small StableHLO building blocks that every lowering rule shares.

Rules never build types, constants, broadcasts or reduce regions by hand; they call these helpers, so that
each piece of PyTorch semantics (how a bool converts, how a comparison treats unsigned ints, how numpy-style
broadcasting aligns dimensions) is written once. All helpers need an active MLIR context, location and
insertion point, which the graph lowering sets up around each rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.types import NUMPY_DTYPES, element_type, spec_of, tensor_type

Value = ir.Value


def shape_of(value: Value) -> tuple[int, ...]:
    return tuple(ir.RankedTensorType(value.type).shape)


def dtype_of(value: Value) -> torch.dtype:
    return spec_of(value).dtype


def rank_of(value: Value) -> int:
    return ir.RankedTensorType(value.type).rank


def _scalar_attr(value: bool | int | float, dtype: torch.dtype) -> ir.Attribute:
    elem = element_type(dtype)
    if dtype.is_floating_point:
        return ir.FloatAttr.get(elem, float(value))
    if dtype is torch.bool:
        return ir.IntegerAttr.get(elem, int(bool(value)))
    return ir.IntegerAttr.get(elem, int(value))


def constant(value: bool | int | float, dtype: torch.dtype, shape: Sequence[int] = ()) -> Value:
    """A splat constant of ``shape`` filled with the Python scalar ``value`` cast to ``dtype``."""
    if not dtype.is_floating_point:
        value = int(value)  # a float filling an integer tensor truncates toward zero, as in torch
        if dtype is not torch.bool:
            info = torch.iinfo(dtype)
            span = info.max - info.min + 1
            value = (value - info.min) % span + info.min  # wrap around, as a torch integer cast does
    attr = ir.DenseElementsAttr.get_splat(tensor_type(tuple(shape), dtype), _scalar_attr(value, dtype))
    return hlo.constant(attr)


def dense_constant(array: torch.Tensor) -> Value:
    """A constant holding the contents of a (CPU) tensor, in its own dtype."""
    tensor = array.detach().to("cpu").contiguous()
    dtype = tensor.dtype
    ttype = tensor_type(tuple(tensor.shape), dtype)
    flat = tensor.reshape(-1)
    if flat.numel() > 0 and bool((flat == flat[0]).all()):
        return constant(flat[0].item(), dtype, tuple(tensor.shape))
    if dtype is torch.bfloat16:
        data = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    elif dtype is torch.bool:
        data = tensor.numpy()  # the bindings pack a numpy bool array into i1 themselves
    else:
        data = tensor.numpy().astype(NUMPY_DTYPES[dtype], copy=False)
    return hlo.constant(ir.DenseElementsAttr.get(np.ascontiguousarray(data), type=ttype.element_type,
                                                 shape=list(tensor.shape)))


def convert(value: Value, dtype: torch.dtype) -> Value:
    """Cast with PyTorch semantics; a no-op when the dtype already matches.

    StableHLO's convert already matches torch for the cases that matter: float → int truncates toward
    zero, anything → bool is ``!= 0``, bool → number is 0/1.
    """
    if dtype_of(value) == dtype:
        return value
    return hlo.convert(tensor_type(shape_of(value), dtype), value)


def broadcast_to(value: Value, shape: Sequence[int]) -> Value:
    """NumPy/PyTorch broadcasting: align trailing dimensions, stretch size-1 dimensions."""
    shape = tuple(shape)
    src = shape_of(value)
    if src == shape:
        return value
    offset = len(shape) - len(src)
    if offset < 0 or any(s not in (1, shape[offset + i]) for i, s in enumerate(src)):
        raise ValueError(f"cannot broadcast shape {src} to {shape}")
    return hlo.broadcast_in_dim(
        tensor_type(shape, dtype_of(value)), value, list(range(offset, len(shape)))
    )


def broadcast_in_dims(value: Value, shape: Sequence[int], dims: Sequence[int]) -> Value:
    """Place ``value``'s dimensions at ``dims`` of a result of ``shape`` (explicit broadcast)."""
    return hlo.broadcast_in_dim(tensor_type(tuple(shape), dtype_of(value)), value, list(dims))


def reshape(value: Value, shape: Sequence[int]) -> Value:
    shape = tuple(shape)
    if shape_of(value) == shape:
        return value
    return hlo.reshape(tensor_type(shape, dtype_of(value)), value)


def transpose(value: Value, permutation: Sequence[int]) -> Value:
    permutation = list(permutation)
    if permutation == list(range(len(permutation))):
        return value
    return hlo.transpose(value, permutation)


def _comparison_type(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "FLOAT"
    if dtype is torch.bool or dtype is torch.uint8:
        return "UNSIGNED"
    return "SIGNED"


def compare(lhs: Value, rhs: Value, direction: str) -> Value:
    """Elementwise comparison (``EQ NE LT LE GT GE``) of two same-typed tensors; returns bool."""
    return hlo.compare(
        lhs,
        rhs,
        hlo.ComparisonDirectionAttr.get(direction),
        compare_type=hlo.ComparisonTypeAttr.get(_comparison_type(dtype_of(lhs))),
    )


def select(pred: Value, on_true: Value, on_false: Value) -> Value:
    return hlo.select(pred, on_true, on_false)


def is_nan(value: Value) -> Value:
    return compare(value, value, "NE")


def iota(shape: Sequence[int], dtype: torch.dtype, dimension: int) -> Value:
    return hlo.iota(tensor_type(tuple(shape), dtype), dimension)


def reduce(
    operands: Sequence[Value],
    init_values: Sequence[Value],
    dimensions: Sequence[int],
    body: Callable[[Sequence[Value], Sequence[Value]], Sequence[Value]],
) -> list[Value]:
    """``stablehlo.reduce`` over ``dimensions``; ``body(accumulators, elements)`` builds the combiner."""
    dims = sorted(d % rank_of(operands[0]) for d in dimensions)
    in_shape = shape_of(operands[0])
    out_shape = [s for i, s in enumerate(in_shape) if i not in dims]
    result_types = [tensor_type(out_shape, dtype_of(v)) for v in operands]
    op = hlo.ReduceOp(result_types, list(operands), list(init_values), dims)
    scalar_types = [tensor_type((), dtype_of(v)) for v in operands]
    block = op.regions[0].blocks.append(*scalar_types, *scalar_types)
    count = len(operands)
    with ir.InsertionPoint(block):
        args = list(block.arguments)
        hlo.return_(list(body(args[:count], args[count:])))
    return list(op.results)


def reduce_window(
    operand: Value,
    init_value: Value,
    window: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    body: Callable[[Value, Value], Value],
    base_dilations: Sequence[int] | None = None,
    window_dilations: Sequence[int] | None = None,
) -> Value:
    """``stablehlo.reduce_window`` with a binary combiner; shapes follow the StableHLO formula."""
    in_shape = shape_of(operand)
    base_dilations = list(base_dilations or [1] * len(in_shape))
    window_dilations = list(window_dilations or [1] * len(in_shape))
    out_shape = []
    for size, w, s, (lo, hi), bd, wd in zip(
        in_shape, window, strides, padding, base_dilations, window_dilations, strict=True
    ):
        dilated = (size - 1) * bd + 1 + lo + hi
        dilated_window = (w - 1) * wd + 1
        out_shape.append(max(0, (dilated - dilated_window) // s + 1))
    dtype = dtype_of(operand)
    op = hlo.ReduceWindowOp(
        [tensor_type(out_shape, dtype)],
        [operand],
        [init_value],
        list(window),
        window_strides=list(strides),
        base_dilations=base_dilations,
        window_dilations=window_dilations,
        padding=ir.DenseIntElementsAttr.get(
            np.asarray(padding, dtype=np.int64).reshape(len(in_shape), 2)
        ),
    )
    scalar = tensor_type((), dtype)
    block = op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        hlo.return_([body(*block.arguments)])
    return op.result


def dot_general(
    lhs: Value,
    rhs: Value,
    contracting: tuple[Sequence[int], Sequence[int]],
    batch: tuple[Sequence[int], Sequence[int]] = ((), ()),
    out_dtype: torch.dtype | None = None,
) -> Value:
    """``stablehlo.dot_general``; the result holds batch dims, then lhs free dims, then rhs free dims."""
    lhs_shape, rhs_shape = shape_of(lhs), shape_of(rhs)
    (lc, rc), (lb, rb) = contracting, batch
    free_l = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    free_r = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
    out_shape = [lhs_shape[d] for d in lb] + [lhs_shape[d] for d in free_l] + [rhs_shape[d] for d in free_r]
    dims = hlo.DotDimensionNumbers.get(
        lhs_batching_dimensions=list(lb),
        rhs_batching_dimensions=list(rb),
        lhs_contracting_dimensions=list(lc),
        rhs_contracting_dimensions=list(rc),
    )
    dtype = out_dtype or dtype_of(lhs)
    return hlo.dot_general(tensor_type(out_shape, dtype), lhs, rhs, dims)


def slice_static(value: Value, starts: Sequence[int], limits: Sequence[int], strides: Sequence[int]) -> Value:
    return hlo.slice(value, list(starts), list(limits), list(strides))


def concatenate(values: Sequence[Value], dimension: int) -> Value:
    if len(values) == 1:
        return values[0]
    return hlo.concatenate(list(values), dimension)


def min_value(dtype: torch.dtype) -> bool | int | float:
    """The identity of ``max``: -inf for floats, the smallest integer otherwise."""
    if dtype.is_floating_point:
        return float("-inf")
    if dtype is torch.bool:
        return False
    return torch.iinfo(dtype).min


def max_value(dtype: torch.dtype) -> bool | int | float:
    """The identity of ``min``: +inf for floats, the largest integer otherwise."""
    if dtype.is_floating_point:
        return float("inf")
    if dtype is torch.bool:
        return True
    return torch.iinfo(dtype).max


def scatter(
    operand: Value,
    indices: Value,
    updates: Value,
    dimension_numbers: ir.Attribute,
    combiner: Callable[[Value, Value], Value],
    unique_indices: bool = False,
) -> Value:
    """``stablehlo.scatter`` of one operand; ``combiner(current, update)`` builds the update region.

    Written once here because the region is built by hand, as in ``reduce``; the result has the operand's
    type.
    """
    dtype = dtype_of(operand)
    op = hlo.ScatterOp(
        [operand.type], [operand], indices, [updates], dimension_numbers, unique_indices=unique_indices
    )
    scalar = tensor_type((), dtype)
    block = op.regions[0].blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        hlo.return_([combiner(*block.arguments)])
    return op.results[0]
