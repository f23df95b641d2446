"""Matrix products of merged views, kept unmerged in bucketed programs.

PyTorch lowers ``linear`` on a ``(b, s, k)`` input to ``view(b * s, k)``, a matrix product and ``view(b, s,
n)``; its backward merges the same way. With ``s`` runtime-sized, merging it under a fixed ``b`` makes XLA
pack the actual rows to the front of the merged dimension at run time (a gather or sort over the whole
tensor, on every call where the size is short of its bucket), and splitting the product again needs another
gather. Neither is needed: a ``dot_general`` contracts ``k`` with ``b`` and ``s`` left as they are, and the
weight's gradient contracts over ``b`` and ``s`` together. So in a bucketed program such a view is kept as
its unmerged value (``Unmerged``), matrix products take it as it is, a view back to the leading sizes takes
the value itself, and anything else gets the merged value (XLA's packing, exact, slower).

XLA's CPU compiler still merges a product's free dimensions into one before it runs it, and packs the rows
again there. Where the runtime-sized dimensions are all free (``linear``'s forward, not the weight's
gradient, which sums over them), each result row depends on its own operand row alone, so the product may as
well run over the whole bucket: with ``OnPadding`` the operand's sizes are dropped before the product (the
padding rows then cost their flops) and the result is marked with them after.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder

aten = torch.ops.aten

_VIEWS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})
_TRANSPOSES = frozenset({aten.t.default, aten.permute.default, aten.transpose.int})


@dataclasses.dataclass(frozen=True)
class OnPadding:
    """How the lowering drops a value's runtime sizes along some dimensions (``dynamic_sizes.fixed_shape``)
    and marks them again (``dynamic_sizes.mark_dynamic``), for products run over the whole bucket."""

    drop: Callable[[ir.Value, list[int]], ir.Value]
    mark: Callable[[ir.Value, list[tuple[int, sympy.Expr]]], ir.Value]
    runtime: frozenset[sympy.Symbol]

    def run(self, operand: Unmerged, product: Callable[[ir.Value], ir.Value]) -> ir.Value:
        """``product`` of ``operand``'s value with its runtime sizes dropped, its result marked with them."""
        dims = [(d, expr) for d, expr in enumerate(operand.lead_sizes) if expr.free_symbols & self.runtime]
        if not dims:
            return product(operand.value)
        return self.mark(product(self.drop(operand.value, [d for d, _ in dims])), dims)


@dataclasses.dataclass(frozen=True)
class Unmerged:
    """A 2-D view ``(prod(lead), last)`` of ``value`` (shape ``lead + (last,)``), or its transpose."""

    value: ir.Value
    lead: tuple[int, ...]
    lead_sizes: tuple[sympy.Expr, ...]
    """The leading dimensions' sizes as expressions, to recognise a view back to them."""
    transposed: bool = False

    def merged(self) -> ir.Value:
        """The view itself (XLA packs a runtime-sized dimension merged inside another)."""
        shape = builder.shape_of(self.value)
        merged = builder.reshape(self.value, (math.prod(shape[:-1]), shape[-1]))
        return builder.transpose(merged, (1, 0)) if self.transposed else merged


def _exprs(shape: Any) -> tuple[sympy.Expr, ...]:
    return tuple(sympy.sympify(s.node.expr) if isinstance(s, torch.SymInt) else sympy.Integer(int(s)) for s in shape)


def _packs(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> bool:
    """Whether ``node`` is a view merging all but the last dimension, among which a runtime-sized one that is
    not the outermost of them (the merge XLA packs)."""
    if node.target not in _VIEWS:
        return False
    before, after = node.args[0].meta["val"], node.meta["val"]
    if before.dim() < 3 or after.dim() != 2 or _exprs(before.shape)[-1] != _exprs(after.shape)[-1]:
        return False
    lead = [expr for expr in _exprs(before.shape)[:-1] if expr != 1]
    return any(expr.free_symbols & runtime for expr in lead[1:])


def lower(node: torch.fx.Node, env: dict, runtime: frozenset[sympy.Symbol], out_dtype: torch.dtype | None,
          on_padding: OnPadding | None = None) -> Any:
    """``node`` lowered with its unmerged operands, or None when it is not one this module handles; products
    whose runtime-sized dimensions are all free run over the whole bucket with ``on_padding``."""
    if _packs(node, runtime):
        source = node.args[0]
        value = env[source]
        if isinstance(value, Unmerged):
            return None
        val = source.meta["val"]
        return Unmerged(value, tuple(builder.shape_of(value)[:-1]), _exprs(val.shape)[:-1])
    operands = [env.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
    if not any(isinstance(o, Unmerged) for o in operands):
        return None
    first = operands[0]
    if node.target in _TRANSPOSES and isinstance(first, Unmerged):
        if node.target is aten.permute.default and list(node.args[1]) != [1, 0]:
            return None
        return dataclasses.replace(first, transposed=not first.transposed)
    if node.target in _VIEWS and isinstance(first, Unmerged) and not first.transposed:
        target = _exprs(node.meta["val"].shape)
        trailing = node.meta["val"].shape[len(first.lead):]
        if target[:len(first.lead_sizes)] != first.lead_sizes or any(isinstance(s, torch.SymInt) for s in trailing):
            return None
        shape = builder.shape_of(first.value)
        return builder.reshape(first.value, (*shape[:len(first.lead)], *(int(s) for s in trailing)))
    if node.target is aten.mm.default:
        return _product(operands[0], operands[1], out_dtype, on_padding=on_padding)
    if node.target is aten.addmm.default and not node.kwargs:
        return _product(operands[1], operands[2], out_dtype, bias=env[node.args[0]], on_padding=on_padding)
    return None


def _product(lhs: Any, rhs: Any, out_dtype: torch.dtype | None, bias: Any = None,
             on_padding: OnPadding | None = None) -> Any:
    """``lhs @ rhs (+ bias)`` where either is unmerged; None for a pairing not handled. ``on_padding``: how a
    product whose runtime-sized dimensions are all free runs over the whole bucket."""
    if isinstance(lhs, Unmerged) and not lhs.transposed and isinstance(rhs, ir.Value) and not isinstance(
            bias, Unmerged):
        rank = len(lhs.lead) + 1

        def product(value: ir.Value) -> ir.Value:
            result = _dot(value, rhs, ((rank - 1,), (0,)), out_dtype)
            if bias is not None:
                acc = builder.dtype_of(result)
                result = hlo.add(result, builder.broadcast_to(builder.convert(bias, acc), builder.shape_of(result)))
            return builder.convert(result, out_dtype)

        value = product(lhs.value) if on_padding is None else on_padding.run(lhs, product)
        return Unmerged(value, lhs.lead, lhs.lead_sizes)
    if (isinstance(lhs, Unmerged) and lhs.transposed and isinstance(rhs, Unmerged) and not rhs.transposed
            and lhs.lead == rhs.lead and lhs.lead_sizes == rhs.lead_sizes and bias is None):
        dims = tuple(range(len(lhs.lead)))
        return builder.convert(_dot(lhs.value, rhs.value, (dims, dims), out_dtype), out_dtype)
    return None


def _dot(lhs: ir.Value, rhs: ir.Value, contracting: tuple, out_dtype: torch.dtype) -> ir.Value:
    """As the matrix-product rules do: operands in the result dtype, accumulated in its accumulator dtype."""
    lhs, rhs = builder.convert(lhs, out_dtype), builder.convert(rhs, out_dtype)
    return builder.dot_general(lhs, rhs, contracting, ((), ()), out_dtype=builder.accumulator_dtype(out_dtype))


def materialize(value: Any) -> Any:
    """``value`` with every ``Unmerged`` in it merged."""
    if isinstance(value, Unmerged):
        return value.merged()
    if isinstance(value, (list, tuple)):
        return type(value)(materialize(v) for v in value)
    return value

