"""Elementwise comparisons, selection and rounding toward zero, with PyTorch's semantics."""

from __future__ import annotations

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering.builder.constants import constant_like
from tpucompile.lowering.builder.dtypes import dtype_of


def _comparison_type(dtype: torch.dtype) -> str:
    if dtype.is_floating_point or dtype.is_complex:
        return "FLOAT"
    if dtype is torch.bool or dtype is torch.uint8:
        return "UNSIGNED"
    return "SIGNED"


def compare(lhs: ir.Value, rhs: ir.Value, direction: str) -> ir.Value:
    """Elementwise comparison (``EQ NE LT LE GT GE``) of two same-typed tensors; returns bool."""
    return hlo.compare(
        lhs,
        rhs,
        hlo.ComparisonDirectionAttr.get(direction),
        compare_type=hlo.ComparisonTypeAttr.get(_comparison_type(dtype_of(lhs))),
    )


def select(pred: ir.Value, on_true: ir.Value, on_false: ir.Value) -> ir.Value:
    return hlo.select(pred, on_true, on_false)


def is_nan(value: ir.Value) -> ir.Value:
    return compare(value, value, "NE")


def trunc(value: ir.Value) -> ir.Value:
    """Round toward zero (``torch.trunc``); integers are returned as they are."""
    if not dtype_of(value).is_floating_point:
        return value
    negative = compare(value, constant_like(0, value), "LT")
    return select(negative, hlo.ceil(value), hlo.floor(value))
