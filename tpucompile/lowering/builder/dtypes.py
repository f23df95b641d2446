"""Element types: the dtype a value holds, PyTorch-style casts, the dtype a computation runs in, and the
identities of max and min."""

from __future__ import annotations

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.types import spec_of, tensor_type


def dtype_of(value: ir.Value) -> torch.dtype:
    return spec_of(value).dtype


def convert(value: ir.Value, dtype: torch.dtype) -> ir.Value:
    """Cast with PyTorch semantics; a no-op when the dtype already matches.

    StableHLO's convert already matches torch for the cases that matter: float → int truncates toward
    zero, anything → bool is ``!= 0``, bool → number is 0/1. Complex to real keeps the real part, as torch
    does.
    """
    spec = spec_of(value)
    if spec.dtype == dtype:
        return value
    if spec.dtype.is_complex and not dtype.is_complex:
        # torch keeps the real part (and warns); StableHLO leaves complex-to-real converts undefined.
        value = hlo.real(value)
        return convert(value, dtype)
    if dtype.is_complex and not spec.dtype.is_complex and spec.dtype is not dtype.to_real():
        value = convert(value, dtype.to_real())  # a real part of the complex type's own width, imaginary 0
    return hlo.convert(tensor_type(spec.shape, dtype), value)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute (and accumulate) ``dtype`` values in: f32 for bf16/f16, which PyTorch's CPU
    kernels widen and round once at the end; any other dtype, integers and f64 included, as it is."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


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
