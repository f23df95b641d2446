"""Sizes a program learns when it runs: bounded dynamic dimensions for bucketed executables.

A bucketed program is lowered at the bucket's sizes (every size symbol bound to its bucket, so every type is
static) and takes each symbol's actual value as an extra ``i32`` argument. Every value with a dimension that
depends on a symbol is marked with ``stablehlo.set_dimension_size`` (its actual extent, computed from the size
arguments) and converted back to its static type, so the lowering rules keep seeing static shapes while XLA's
dynamic dimension inference follows the marks through the program: its dynamic padder makes reductions,
matrix products and the rest ignore what lies past the actual extent. The padding sits at the end of each
dimension, and results are narrowed to their actual sizes after the call.

Only size expressions that never shrink as a symbol grows can be bounded by their value at the bucket; the
others (``Mod``, a negative coefficient) make the graph compile per size instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.contracts.size_expressions import SIZE_DTYPE, UnboundedSize, check_bounded, evaluate, symbolic_dims
from tpucompile.lowering.builder import constant, dtype_of, shape_of
from tpucompile.lowering.types import TensorSpec, tensor_type

__all__ = ["SIZE_DTYPE", "SizeValues", "UnboundedSize", "check_bounded", "computable", "element_count", "evaluate",
           "fixed_shape", "fixed_where_padded", "mark_dynamic", "split_dimension", "static_result", "symbolic_dims",
           "within_actual"]

class SizeValues:
    """The program's values of size expressions, from its ``i32`` size arguments (each expression emitted once
    per program): ``i32`` for integer expressions, ``f32`` for those with floats in them (a mean's backward
    scales by ``1 / (n - 1)``)."""

    def __init__(self, arguments: Mapping[sympy.Symbol, ir.Value]) -> None:
        self._known: dict[sympy.Expr, ir.Value] = dict(arguments)

    def of(self, expr: sympy.Expr) -> ir.Value:
        expr = sympy.sympify(expr)
        found = self._known.get(expr)
        if found is not None:
            return found
        value = self._compute(expr)
        self._known[expr] = value
        return value

    def _compute(self, expr: sympy.Expr) -> ir.Value:
        if isinstance(expr, sympy.Integer):
            return constant(int(expr), SIZE_DTYPE)
        if isinstance(expr, (sympy.Float, sympy.Rational)):
            return constant(float(expr), torch.float32)
        name = type(expr).__name__
        if name == "ToFloat":
            return _as_float(self.of(expr.args[0]))
        if name in ("FloatTrueDiv", "IntTrueDiv"):
            return hlo.divide(_as_float(self.of(expr.args[0])), _as_float(self.of(expr.args[1])))
        if isinstance(expr, sympy.Pow) and isinstance(expr.exp, sympy.Integer):
            base = self.of(expr.base)
            power = base
            for _ in range(abs(int(expr.exp)) - 1):
                power = hlo.multiply(power, base)
            return hlo.divide(constant(1.0, torch.float32), _as_float(power)) if expr.exp < 0 else power
        combine = {"Add": hlo.add, "Mul": hlo.multiply, "FloorDiv": hlo.divide, "CleanDiv": hlo.divide,
                   "Max": hlo.maximum, "Min": hlo.minimum}.get(name)
        if combine is None:
            raise UnboundedSize(f"size expression {expr} has an operation tpucompile cannot compute ({name})")
        args = [self.of(arg) for arg in expr.args]
        if any(_is_float(arg) for arg in args):
            args = [_as_float(arg) for arg in args]
        value = args[0]
        for arg in args[1:]:
            value = combine(value, arg)  # sizes are non-negative: truncating division is floor division
        return value


_OPERATIONS = frozenset({"Add", "Mul", "FloorDiv", "CleanDiv", "Max", "Min", "ToFloat", "FloatTrueDiv",
                         "IntTrueDiv"})


def computable(expr: sympy.Expr) -> bool:
    """Whether ``SizeValues.of`` can compute ``expr`` in the program."""
    expr = sympy.sympify(expr)
    if isinstance(expr, (sympy.Symbol, sympy.Number)):
        return True
    if isinstance(expr, sympy.Pow):
        return isinstance(expr.exp, sympy.Integer) and computable(expr.base)
    return type(expr).__name__ in _OPERATIONS and all(computable(arg) for arg in expr.args)


def _is_float(value: ir.Value) -> bool:
    return dtype_of(value).is_floating_point


def _as_float(value: ir.Value) -> ir.Value:
    return value if _is_float(value) else hlo.convert(tensor_type((), torch.float32), value)


def mark_dynamic(value: ir.Value, spec: TensorSpec, dims: list[tuple[int, sympy.Expr]], sizes: SizeValues) -> ir.Value:
    """``value`` (of static type ``spec``) with each of ``dims`` marked as holding only its expression's value,
    returned in its static type again."""
    if not dims:
        return value
    shape = list(spec.shape)
    dynamic = list(spec.shape)
    marked = value
    for dim, expr in dims:
        dynamic[dim] = ir.ShapedType.get_dynamic_size()
        bounds = [shape[d] if dynamic[d] == ir.ShapedType.get_dynamic_size() else ir.ShapedType.get_dynamic_size()
                  for d in range(len(shape))]
        marked_type = ir.RankedTensorType.get(
            dynamic, tensor_type(tuple(shape), spec.dtype).element_type,
            ir.Attribute.parse(f"#stablehlo.bounds<{', '.join('?' if b < 0 else str(b) for b in bounds)}>"))
        marked = hlo.SetDimensionSizeOp(marked, sizes.of(expr), dim, results=[marked_type]).result
    return hlo.convert(tensor_type(tuple(shape), spec.dtype), marked)


def static_result(value: ir.Value, spec: TensorSpec, dims: list[tuple[int, sympy.Expr]],
                  in_place: bool = False) -> ir.Value:
    """``value`` as a program result of fixed shape: XLA returns a buffer of dynamic shape for a result it
    knows to be runtime-sized, which DLPack cannot carry; results are cut to their actual sizes after the
    call, and a value a forward saves for its backward crosses padded (the backward marks it again)."""
    return fixed_shape(value, [dim for dim, _ in dims], in_place)


def fixed_shape(value: ir.Value, dims: list[int], in_place: bool = False) -> ir.Value:
    """``value`` with the same elements (padding included) in a shape XLA takes as fixed along ``dims``.
    ``in_place``: written whole over a constant by a scatter, which XLA's dynamic padder gives a fixed shape
    and its simplifier then removes, so the value keeps its buffer; else by gathering every position of each
    dimension, a copy. Slices, reshapes, optimisation barriers, sharding annotations and
    ``set_dimension_size`` to the bound all keep XLA's knowledge of the runtime size."""
    if not dims:
        return value
    if in_place:
        return _written_over_constant(value)
    shape = shape_of(value)
    rank = len(shape)
    for dim in dims:
        positions = hlo.iota(tensor_type((shape[dim], 1), SIZE_DTYPE), 0)
        numbers = hlo.GatherDimensionNumbers.get(
            offset_dims=[d for d in range(rank) if d != dim], collapsed_slice_dims=[dim],
            operand_batching_dims=[], start_indices_batching_dims=[], start_index_map=[dim], index_vector_dim=1)
        sizes = [1 if d == dim else shape[d] for d in range(rank)]
        value = hlo.gather(value, positions, numbers, ir.DenseI64ArrayAttr.get(sizes), indices_are_sorted=True)
    return value


def _written_over_constant(value: ir.Value) -> ir.Value:
    shape, dtype = shape_of(value), dtype_of(value)
    rank = len(shape)
    numbers = hlo.ScatterDimensionNumbers.get(
        update_window_dims=list(range(rank)), inserted_window_dims=[], input_batching_dims=[],
        scatter_indices_batching_dims=[], scattered_dims_to_operand_dims=[0], index_vector_dim=0)
    start = constant(0, SIZE_DTYPE, (1,))
    scatter = hlo.ScatterOp([value.type], [constant(0, dtype, shape)], start, [value], numbers,
                            indices_are_sorted=True, unique_indices=True)
    scalar = tensor_type((), dtype)
    block = scatter.update_computation.blocks.append(scalar, scalar)
    with ir.InsertionPoint(block):
        hlo.ReturnOp([block.arguments[1]])
    return scatter.results[0]


def fixed_where_padded(value: ir.Value, meta: Any, extent: Callable[[Any, int], ir.Value | None],
                       in_place: bool = False) -> ir.Value:
    """``value`` (the lowered ``meta``) fixed in shape along each dimension a bucket pads (``extent``, the
    lowering context's, says which): for ops XLA's dynamic padder cannot carry a runtime size through."""
    if not isinstance(meta, torch.Tensor):
        return value
    return fixed_shape(value, [d for d in range(meta.dim()) if extent(meta, d) is not None], in_place)


def element_count(extent: Callable[[Any, int], ir.Value | None], meta: Any, shape: Sequence[int],
                  dims: Sequence[int]) -> int | ir.Value:
    """How many elements of an operand (``meta``, of static ``shape``) a reduction over ``dims`` takes in: a
    number, or where a bucket pads some of ``dims``, the product with their actual extents (``extent``, the
    lowering context's; an ``i32`` scalar), since the padding is not counted."""
    static, actual = 1, None
    for d in dims:
        size = extent(meta, d)
        if size is None:
            static *= shape[d]
        else:
            actual = size if actual is None else hlo.multiply(actual, size)
    if actual is None:
        return static
    if static != 1:
        actual = hlo.multiply(actual, constant(static, SIZE_DTYPE, ()))
    return actual


def within_actual(shape: tuple[int, ...], dim: int, extent: ir.Value) -> ir.Value:
    """A boolean tensor of ``shape``: whether each position along ``dim`` lies before the actual extent
    ``extent`` (an ``i32`` scalar), i.e. is not padding."""
    positions = hlo.iota(tensor_type(tuple(shape), SIZE_DTYPE), dim)
    limit = hlo.broadcast_in_dim(tensor_type(tuple(shape), SIZE_DTYPE), extent, ir.DenseI64ArrayAttr.get([]))
    return hlo.compare(positions, limit, hlo.ComparisonDirectionAttr.get("LT"))


def split_dimension(
    value: ir.Value, spec: TensorSpec, dim: int, group: list[tuple[int, sympy.Expr]], sizes: SizeValues
) -> ir.Value:
    """``value`` with dimension ``dim`` split into ``group`` ((bucket size, actual size) per new dimension,
    outermost first), gathering each element from its place among the actual elements: the merged dimension
    holds them packed at its start (XLA packs a padded dimension merged with others), where a plain reshape
    would take the padding of the inner dimensions as data."""
    shape = [bucket for bucket, _ in group]
    index = None
    for position in range(len(group)):
        stride = sympy.Integer(1)
        for _, actual in group[position + 1:]:
            stride *= actual
        term = hlo.iota(tensor_type(tuple(shape), SIZE_DTYPE), position)
        if stride != 1:
            term = hlo.multiply(term, hlo.broadcast_in_dim(tensor_type(tuple(shape), SIZE_DTYPE), sizes.of(stride),
                                                           ir.DenseI64ArrayAttr.get([])))
        index = term if index is None else hlo.add(index, term)
    index = hlo.reshape(tensor_type((*shape, 1), SIZE_DTYPE), index)
    rank = len(spec.shape)
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[*range(dim), *range(dim + len(group), rank - 1 + len(group))], collapsed_slice_dims=[dim],
        operand_batching_dims=[], start_indices_batching_dims=[], start_index_map=[dim], index_vector_dim=len(group))
    slice_sizes = [1 if d == dim else spec.shape[d] for d in range(rank)]
    return hlo.gather(value, index, numbers, ir.DenseI64ArrayAttr.get(slice_sizes), indices_are_sorted=True)
