"""PyTorch dtypes and shapes as MLIR types, and back.

Unsigned integers map to MLIR's unsigned types (``ui8``) so that a type always says which torch dtype it
holds; every other integer is signless, as StableHLO expects.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from jax.extend.mlir import ir

from tpucompile.errors import UnsupportedOpError


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """The static type of one tensor in a lowered program: concrete shape and torch dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{', '.join(map(str, self.shape))}]"


def _element_type_builders() -> dict[torch.dtype, object]:
    return {
        torch.float32: ir.F32Type.get,
        torch.float64: ir.F64Type.get,
        torch.float16: ir.F16Type.get,
        torch.bfloat16: ir.BF16Type.get,
        torch.bool: lambda: ir.IntegerType.get_signless(1),
        torch.int8: lambda: ir.IntegerType.get_signless(8),
        torch.int16: lambda: ir.IntegerType.get_signless(16),
        torch.int32: lambda: ir.IntegerType.get_signless(32),
        torch.int64: lambda: ir.IntegerType.get_signless(64),
        torch.uint8: lambda: ir.IntegerType.get_unsigned(8),
        torch.complex64: lambda: ir.ComplexType.get(ir.F32Type.get()),
        torch.complex128: lambda: ir.ComplexType.get(ir.F64Type.get()),
    }


_BUILDERS = _element_type_builders()
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(_BUILDERS)

NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bool: np.dtype(np.bool_),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}


def element_type(dtype: torch.dtype) -> ir.Type:
    """The MLIR element type of a torch dtype (needs an active MLIR context)."""
    try:
        return _BUILDERS[dtype]()
    except KeyError:
        raise UnsupportedOpError(f"dtype {dtype} is not supported by tpucompile") from None


def tensor_type(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(shape), element_type(dtype))


def spec_type(spec: TensorSpec) -> ir.RankedTensorType:
    return tensor_type(spec.shape, spec.dtype)


_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f64": torch.float64,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i1": torch.bool,
    "i8": torch.int8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "ui8": torch.uint8,
    "complex<f32>": torch.complex64,
    "complex<f64>": torch.complex128,
}


def torch_dtype_of(type_: ir.Type) -> torch.dtype:
    """The torch dtype of an MLIR tensor or element type."""
    if isinstance(type_, ir.RankedTensorType):
        type_ = type_.element_type
    try:
        return _DTYPES_BY_NAME[str(type_)]
    except KeyError:
        raise UnsupportedOpError(f"MLIR type {type_} has no torch dtype") from None


def spec_of(value: ir.Value) -> TensorSpec:
    """Shape and torch dtype of an MLIR tensor value."""
    ranked = ir.RankedTensorType(value.type)
    return TensorSpec(tuple(ranked.shape), torch_dtype_of(ranked.element_type))
