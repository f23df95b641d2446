"""Values made from Python numbers and CPU tensors (splat and dense constants, iota), and scaling by a Python
scalar."""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.builder.dtypes import dtype_of
from tpucompile.lowering.builder.shapes import shape_of
from tpucompile.lowering.types import NUMPY_DTYPES, element_type, tensor_type


def _scalar_attr(value: bool | int | float, dtype: torch.dtype) -> ir.Attribute:
    elem = element_type(dtype)
    if dtype.is_floating_point:
        return ir.FloatAttr.get(elem, float(value))
    if dtype is torch.bool:
        return ir.IntegerAttr.get(elem, int(bool(value)))
    return ir.IntegerAttr.get(elem, int(value))


def constant(value: bool | int | float | complex, dtype: torch.dtype, shape: Sequence[int] = ()) -> ir.Value:
    """A splat constant of ``shape`` filled with the Python scalar ``value`` cast to ``dtype``."""
    if dtype.is_complex:
        # No complex attribute in the bindings' scalar builders: the splat is made of its two float parts.
        part = dtype.to_real()
        value = complex(value)
        return hlo.complex(constant(value.real, part, shape), constant(value.imag, part, shape))
    if not dtype.is_floating_point:
        value = int(value)  # a float filling an integer tensor truncates toward zero, as in torch
        if dtype is not torch.bool:
            info = torch.iinfo(dtype)
            span = info.max - info.min + 1
            value = (value - info.min) % span + info.min  # wrap around, as a torch integer cast does
    attr = ir.DenseElementsAttr.get_splat(tensor_type(tuple(shape), dtype), _scalar_attr(value, dtype))
    return hlo.constant(attr)


def constant_like(value: bool | int | float | complex, like: ir.Value) -> ir.Value:
    """A splat of ``value`` with the dtype and shape of ``like``."""
    return constant(value, dtype_of(like), shape_of(like))


def dense_constant(array: torch.Tensor) -> ir.Value:
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


def iota(shape: Sequence[int], dtype: torch.dtype, dimension: int) -> ir.Value:
    return hlo.iota(tensor_type(tuple(shape), dtype), dimension)


def scaled(value: ir.Value, factor: bool | int | float) -> ir.Value:
    """``value * factor`` (ATen's ``alpha`` and ``beta``); ``value`` itself when ``factor`` is 1."""
    if factor == 1:
        return value
    return hlo.multiply(value, constant_like(factor, value))
