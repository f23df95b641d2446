"""CPU programs: ``stablehlo.dot_general`` → a call of the host BLAS kernel (``tpucompile_host_gemm``).

A dot qualifies when it is a (batched) matrix product the kernel computes on row-major buffers without
moving data: batch dimensions leading and in order in both operands, one contracting dimension that is the
first or the last non-batch dimension, the free dimensions contiguous and in the order the result keeps
them, dtypes the kernel has (f32, f64, bf16 x bf16 -> f32, and bf16 x bf16 -> bf16 as that product rounded
after the call) and sizes that fit 32-bit BLAS integers. Such a
dot becomes reshape → custom call → reshape; the reshapes only regroup dimensions, so XLA makes them
bitcasts. An operand that is a ``stablehlo.transpose`` is read through it whenever that qualifies (a ``Linear``'s
``x @ w.T`` reads ``w`` with the kernel's transpose flag instead of copying it): XLA cannot fold a transpose
into a custom call as it does into its own dots. Every other dot stays with XLA.

Which qualifying dots are rewritten is decided per dot by timing (``kernel_choice``). The rewrite happens
only when a program is compiled for this process's CPU; the stored StableHLO program is not touched, so it
stays portable to any target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.runtime.host_kernels.ffi_calls import ffi_call
from tpucompile.runtime.host_kernels.library import TARGET_NAME

_INT32_MAX = 2**31 - 1


def dot_replacements(dtypes: frozenset[str]) -> dict[str, Callable[[Any], bool]]:
    """What ``mlir_walk.rewrite_each`` calls to rewrite the dots for ``dtypes`` (``kernel_choice`` combines it
    with the other rewrites)."""
    return {"stablehlo.dot_general": lambda dot: _replace(dot, dtypes)}


_KERNEL_DTYPES = {("f32", "f32", "f32"): "f32", ("f64", "f64", "f64"): "f64", ("bf16", "bf16", "f32"): "bf16",
                  ("bf16", "bf16", "bf16"): "bf16"}
"""(lhs, rhs, result) element types → the kernel that computes them (a bf16 result: its f32 one, rounded)."""


def _replace(dot: Any, dtypes: frozenset[str]) -> bool:
    if "algorithm" in dot.attributes:
        return False
    lhs, rhs = dot.operands
    lhs_type, rhs_type = ir.RankedTensorType(lhs.type), ir.RankedTensorType(rhs.type)
    out_type = ir.RankedTensorType(dot.results[0].type)
    if not (lhs_type.has_static_shape and rhs_type.has_static_shape and out_type.has_static_shape):
        return False
    elements = (str(lhs_type.element_type), str(rhs_type.element_type), str(out_type.element_type))
    if _KERNEL_DTYPES.get(elements) not in dtypes:
        return False
    numbers = hlo.DotDimensionNumbers(dot.attributes["dot_dimension_numbers"])
    lhs_batch, rhs_batch = list(numbers.lhs_batching_dimensions), list(numbers.rhs_batching_dimensions)
    lhs_contracting = list(numbers.lhs_contracting_dimensions)
    rhs_contracting = list(numbers.rhs_contracting_dimensions)
    if len(lhs_contracting) != 1 or len(rhs_contracting) != 1:
        return False
    left = _as_matrix(lhs, lhs_batch, lhs_contracting[0], contracting_last=True)
    right = _as_matrix(rhs, rhs_batch, rhs_contracting[0], contracting_last=False)
    if left is None or right is None:
        return False
    (lhs_value, lhs_shape, transpose_lhs), (rhs_value, rhs_shape, transpose_rhs) = left, right
    out_shape = list(out_type.shape)
    batch = math.prod(out_shape[: len(lhs_batch)])
    m = lhs_shape[2] if transpose_lhs else lhs_shape[1]
    n = rhs_shape[1] if transpose_rhs else rhs_shape[2]
    k = lhs_shape[1] if transpose_lhs else lhs_shape[2]
    if 0 in (batch, m, n, k) or max(m, n, k) > _INT32_MAX or batch * m * n != math.prod(out_shape):
        return False
    with ir.InsertionPoint(dot), dot.location:
        lhs3 = hlo.reshape(ir.RankedTensorType.get(lhs_shape, lhs_type.element_type), lhs_value)
        rhs3 = hlo.reshape(ir.RankedTensorType.get(rhs_shape, rhs_type.element_type), rhs_value)
        accumulated = ir.F32Type.get() if elements == ("bf16", "bf16", "bf16") else out_type.element_type
        call = ffi_call(TARGET_NAME, [ir.RankedTensorType.get([batch, m, n], accumulated)],
                        [lhs3, rhs3], {"transpose_lhs": transpose_lhs, "transpose_rhs": transpose_rhs}).result
        if accumulated != out_type.element_type:
            call = hlo.convert(ir.RankedTensorType.get([batch, m, n], out_type.element_type), call)
        result = hlo.reshape(out_type, call)
    dot.results[0].replace_all_uses_with(result)
    dot.erase()
    return True


def _as_matrix(value: Any, batch: Sequence[int], contracting: int, contracting_last: bool) -> tuple | None:
    """(value to pass, its shape as [B, rows, cols], transposed?) for one operand, or None. Transposes that
    define the operand are read through, the outermost source that qualifies first: the kernel's flag replaces
    XLA's copy, and a chain such as AOTAutograd's ``permute(permute(w))`` reads ``w`` itself."""
    shape = list(ir.RankedTensorType(value.type).shape)
    free = [d for d in range(len(shape)) if d not in batch and d != contracting]
    candidates = [(value, list(range(len(shape))))]  # (source, where each operand dim lies in the source)
    while True:
        source, where = candidates[-1]
        owner = source.owner
        if isinstance(owner, ir.Block) or owner.operation.name != "stablehlo.transpose":
            break
        permutation = list(ir.DenseI64ArrayAttr(owner.attributes["permutation"]))
        candidates.append((owner.operands[0], [permutation[d] for d in where]))
    for source, where in reversed(candidates):
        layout = _layout(list(ir.RankedTensorType(source.type).shape), [where[d] for d in batch],
                         where[contracting], [where[d] for d in free], contracting_last)
        if layout is not None:
            return source, layout[0], layout[1]
    return None


def _layout(shape: list[int], batch: Sequence[int], contracting: int, free: Sequence[int],
            contracting_last: bool) -> tuple[list[int], bool] | None:
    """How a row-major operand reads as [B, rows, cols] for the kernel: its batch dims lead in order, its free
    dims are contiguous in the order given, and the contracting dim sits on one side of them. The kernel's
    untransposed lhs is [B, M, K] (``contracting_last``), its untransposed rhs [B, K, N]."""
    nb = len(batch)
    if list(batch) != list(range(nb)):
        return None
    b = math.prod(shape[:nb])
    k = shape[contracting]
    f = math.prod(shape[d] for d in free)
    if contracting == len(shape) - 1:  # [..., F, K]
        return ([b, f, k], not contracting_last) if free == list(range(nb, len(shape) - 1)) else None
    if contracting == nb:  # [..., K, F]
        return ([b, k, f], contracting_last) if free == list(range(nb + 1, len(shape))) else None
    return None
