"""Size expressions of graphs with symbolic sizes: their values for a call, whether a bucket's value bounds
them, and where a call's arguments hold each symbol.

Shared by the lowering of bucketed programs (``lowering.dynamic_sizes``) and the runtime that pads calls to
buckets (``buckets``): sympy expressions over the size symbols Dynamo put in a graph's traced values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

SIZE_DTYPE = torch.int32
"""The type of a size argument (``set_dimension_size`` takes an ``i32``)."""


class UnboundedSize(Exception):
    """A size expression whose value at the bucket does not bound its value below it."""


def _floor_div(a: int, b: int) -> int:
    return a // b


_PYTHON: dict[str, Callable[..., int]] = {
    "Add": lambda *xs: sum(xs),
    "Mul": lambda *xs: _product(xs),
    "FloorDiv": _floor_div,
    "CleanDiv": _floor_div,
    "Max": lambda *xs: max(xs),
    "Min": lambda *xs: min(xs),
}


def _product(values: tuple[int, ...]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def evaluate(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> int:
    """The value of a size expression for concrete symbol values (the forms ``check_bounded`` admits)."""
    if isinstance(expr, sympy.Symbol):
        return int(values[expr])
    if isinstance(expr, (sympy.Integer, int)):
        return int(expr)
    operation = _PYTHON.get(type(expr).__name__)
    if operation is None:
        raise UnboundedSize(f"size expression {expr} has an operation tpucompile cannot bound ({type(expr).__name__})")
    return operation(*(evaluate(arg, values) for arg in expr.args))


def check_bounded(expr: sympy.Expr) -> None:
    """Raise ``UnboundedSize`` unless ``expr`` never decreases as any symbol grows (so its value at the bucket
    holds every value below it)."""
    if isinstance(expr, (sympy.Symbol, sympy.Integer, int)):
        return
    name = type(expr).__name__
    if name == "Mul":
        for arg in expr.args:
            if isinstance(arg, sympy.Integer) and arg < 0:
                raise UnboundedSize(f"size expression {expr} shrinks as its symbols grow")
            check_bounded(arg)
        return
    if name in ("Add", "Max", "Min"):
        for arg in expr.args:
            check_bounded(arg)
        return
    if name in ("FloorDiv", "CleanDiv"):
        numerator, divisor = expr.args
        if not (isinstance(divisor, sympy.Integer) and divisor > 0):
            raise UnboundedSize(f"size expression {expr} divides by a size")
        check_bounded(numerator)
        return
    raise UnboundedSize(f"size expression {expr} is not monotone in its symbols ({name})")


def symbolic_dims(val: torch.Tensor, runtime: frozenset[sympy.Symbol]) -> list[tuple[int, sympy.Expr]]:
    """(dimension, size expression) for each dimension of ``val`` that depends on a runtime symbol."""
    dims = []
    for dim, size in enumerate(val.shape):
        if isinstance(size, torch.SymInt):
            expr = sympy.sympify(size.node.expr)
            if expr.free_symbols & runtime:
                dims.append((dim, expr))
    return dims


def runtime_symbols(metas: Sequence[Any]) -> frozenset[sympy.Symbol]:
    """Every size symbol of a graph's inputs (tensor sizes and SymInt arguments)."""
    found: set[sympy.Symbol] = set()
    for meta in metas:
        sizes = meta.shape if isinstance(meta, torch.Tensor) else [meta]
        for size in sizes:
            if isinstance(size, torch.SymInt):
                found |= sympy.sympify(size.node.expr).free_symbols
    return frozenset(found)


def symbol_sources(
    metas: Sequence[Any], symbols: frozenset[sympy.Symbol], last: frozenset[int] = frozenset()
) -> dict[sympy.Symbol, tuple[int, int | None]]:
    """Where each symbol's value is read on a call: (argument position, dimension), or (position, None) for a
    SymInt argument; the arguments at positions in ``last`` only for symbols no other argument has. Symbols
    with no argument of their own are left out."""
    sources: dict[sympy.Symbol, tuple[int, int | None]] = {}
    order = [p for p in range(len(metas)) if p not in last] + sorted(p for p in last if p < len(metas))
    for position in order:
        meta = metas[position]
        if isinstance(meta, torch.SymInt) and meta.node.expr in symbols:
            sources.setdefault(meta.node.expr, (position, None))
        elif isinstance(meta, torch.Tensor):
            for dim, size in enumerate(meta.shape):
                if isinstance(size, torch.SymInt) and size.node.expr in symbols:
                    sources.setdefault(size.node.expr, (position, dim))
    return sources


def read_symbols(
    sources: Mapping[sympy.Symbol, tuple[int, int | None]], args: Sequence[Any]
) -> dict[sympy.Symbol, int]:
    """Each symbol's value in a call's ``args``, from ``symbol_sources``."""
    return {symbol: int(args[position] if dim is None else args[position].shape[dim])
            for symbol, (position, dim) in sources.items()}


def shape_at(meta: torch.Tensor, values: Mapping[sympy.Symbol, int]) -> tuple[int, ...]:
    """``meta``'s shape with its symbols at ``values``."""
    return tuple(evaluate(sympy.sympify(s.node.expr), values) if isinstance(s, torch.SymInt) else int(s)
                 for s in meta.shape)


def runtime_size_assertion(node: Any, runtime: frozenset[sympy.Symbol]) -> tuple[sympy.Expr, str] | None:
    """(condition, message) of a size assertion Dynamo put in a graph (``aten._assert_scalar``: ``u1 <= 24``
    after a ``masked_select``) whose condition depends on a runtime symbol, else None. A bucketed program is
    lowered for the bucket's sizes, where such a condition says nothing of the call's, so the runtime checks
    it per call instead, against the call's values."""
    if getattr(node, "op", None) != "call_function" or node.target is not torch.ops.aten._assert_scalar.default:
        return None
    condition = node.args[0]
    value = condition.meta.get("val") if hasattr(condition, "meta") else condition
    if not isinstance(value, torch.SymBool):
        return None
    expr = sympy.sympify(value.node.expr)
    if not expr.free_symbols & runtime:
        return None
    message = node.args[1] if len(node.args) > 1 else f"size assertion {expr} failed"
    return expr, str(message)
