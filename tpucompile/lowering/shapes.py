"""Concrete sizes for graphs whose sizes are symbolic.

Dynamo hands over a graph with SymInt sizes once it has seen two shapes of an input. Each executable we
compile is static, so before lowering we bind every size symbol to the value it has in this call and
evaluate each node's sizes (sympy expressions over those symbols) to plain ints.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import sympy
import torch

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering.types import TensorSpec


def is_symbolic(value: Any) -> bool:
    """True for SymInt/SymFloat/SymBool, and for tensors with any symbolic size."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in value.shape)
    return False


class ShapeBindings:
    """A map from size symbols to the concrete values of one call."""

    def __init__(
        self, values: dict[sympy.Symbol, int] | None = None, runtime: frozenset[sympy.Symbol] = frozenset(),
        unmerged_products: bool = True, fixed_in_place: bool = True, products_on_padding: bool = True,
        input_extents: dict[int, tuple[int, ...]] | None = None,
    ) -> None:
        self.values: dict[sympy.Symbol, sympy.Expr] = {k: sympy.sympify(v) for k, v in (values or {}).items()}
        self.runtime = frozenset(runtime)
        """Symbols whose value here is a bucket's bound: the program takes their actual values as arguments
        (``dynamic_sizes``)."""
        self.unmerged_products = unmerged_products
        """With ``runtime`` symbols: matrix products take merged views unmerged (``lowering.unmerged``)."""
        self.fixed_in_place = fixed_in_place
        """With ``runtime`` symbols: values leave XLA's size tracking uncopied (``dynamic_sizes.fixed_shape``)."""
        self.products_on_padding = products_on_padding
        """With ``runtime`` symbols: unmerged products whose runtime-sized dimensions are all free run over the
        whole bucket (``lowering.unmerged.OnPadding``)."""
        self.input_extents = dict(input_extents or {})
        """With ``runtime`` symbols: per placeholder index, a shape larger than the bucket's in which the program
        takes that input (a value that comes back from an earlier call padded past its bucket); the program
        slices it to the bucket's shape first."""

    @classmethod
    def from_inputs(cls, metas: Sequence[Any], actuals: Sequence[Any]) -> ShapeBindings:
        """Bind symbols by matching placeholder metadata (fake tensors, SymInts) against real arguments."""
        bindings = cls()
        for meta, actual in zip(metas, actuals, strict=True):
            if isinstance(meta, torch.Tensor):
                for size, real in zip(meta.shape, actual.shape, strict=True):
                    bindings._bind(size, int(real))
            elif isinstance(meta, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                bindings._bind(meta, actual)
        return bindings

    def _bind(self, symbolic: Any, actual: Any) -> None:
        if not isinstance(symbolic, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return
        expr = symbolic.node.expr
        if isinstance(expr, sympy.Symbol):
            self.values.setdefault(expr, sympy.sympify(actual))

    def resolve(self, value: Any) -> Any:
        """A plain Python value for ``value`` (SymInt → int, …), lists and tuples element-wise."""
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = value.node.expr
            concrete = sympy.sympify(sympy.sympify(expr).xreplace(self.values))
            if concrete.free_symbols:
                names = ", ".join(sorted(str(s) for s in concrete.free_symbols))
                raise UnsupportedOpError(
                    f"size expression {expr} depends on data-dependent sizes ({names}); tpucompile compiles "
                    "static shapes and cannot resolve it"
                )
            if isinstance(value, torch.SymInt):
                return int(concrete)
            if isinstance(value, torch.SymBool):
                return bool(concrete)
            return float(concrete)
        if isinstance(value, (list, tuple)):
            return type(value)(self.resolve(v) for v in value)
        return value

    def spec(self, tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(self.resolve(s) for s in tensor.shape), tensor.dtype)

    def check(self, metas: Iterable[Any], actuals: Iterable[Any]) -> None:
        """Raise if a bound input's sizes disagree with its symbolic sizes (e.g. ``2*s0`` against 5)."""
        for meta, actual in zip(metas, actuals, strict=True):
            if isinstance(meta, torch.Tensor):
                expected = self.spec(meta).shape
                if expected != tuple(actual.shape):
                    raise UnsupportedOpError(
                        f"input of shape {tuple(actual.shape)} does not satisfy the symbolic shape "
                        f"{tuple(meta.shape)} (evaluates to {expected})"
                    )
