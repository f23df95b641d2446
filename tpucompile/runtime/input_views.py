"""Outputs of a symbolic graph that are views of its inputs, made as views of the actual inputs.

AOTAutograd regenerates an output that aliases an input from that input. With static sizes it replays the
view ops; with symbolic ones it calls ``as_strided`` on the input with the size, stride and offset of the
tensor the compiled graph returned, so that tensor must have the layout eager would give the view (a program
result is a fresh contiguous tensor: ``chunk`` along a later dimension came back with wrong values, ``expand``
raised). The layout is in the output's traced value, as expressions over the size symbols; evaluated with a
call's sizes, ``as_strided`` on the actual input gives the view itself.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from tpucompile.runtime.size_expressions import UnboundedSize, evaluate


@dataclasses.dataclass(frozen=True)
class InputView:
    """Output ``output`` is a view of argument ``position``: its layout, relative to that argument's."""

    output: int
    position: int
    size: tuple[sympy.Expr, ...]
    stride: tuple[sympy.Expr, ...]
    offset: sympy.Expr


def _expr(value: Any) -> sympy.Expr:
    return sympy.sympify(value.node.expr) if isinstance(value, torch.SymInt) else sympy.Integer(int(value))


def _returns_views(target: Any) -> bool:
    """Whether an op returns views of its first argument (``view``, ``expand``, ``split``, ``unbind``...)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _viewed_placeholder(node: Any) -> torch.fx.Node | None:
    """The placeholder ``node`` is a chain of view ops of, or None (the traced values of an ATen graph do not
    say which tensors are views, the ops do)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and (
            node.target is operator.getitem or _returns_views(node.target)):
        node = node.args[0]
    return node if isinstance(node, torch.fx.Node) and node.op == "placeholder" else None


def input_views(gm: torch.fx.GraphModule) -> list[InputView]:
    """The outputs of ``gm`` that are views of a placeholder, with their layouts to evaluate."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = gm.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    views = []
    for index, out in enumerate(outputs):
        if not isinstance(out, torch.fx.Node) or out.op == "placeholder":
            continue
        source = _viewed_placeholder(out)
        val = out.meta.get("val")
        base = source.meta.get("val") if source is not None else None
        if not isinstance(val, torch.Tensor) or not isinstance(base, torch.Tensor):
            continue
        views.append(InputView(index, placeholders.index(source), tuple(_expr(s) for s in val.shape),
                               tuple(_expr(s) for s in val.stride()),
                               _expr(val.storage_offset()) - _expr(base.storage_offset())))
    return views


def replace_views(outputs: list[Any], views: Sequence[InputView], args: Sequence[Any],
                  values: Mapping[sympy.Symbol, int]) -> list[Any]:
    """``outputs`` with each view of an input remade as that view of the actual argument."""
    for view in views:
        source = args[view.position] if view.position < len(args) else None
        if not isinstance(source, torch.Tensor):
            continue
        try:
            size = [evaluate(e, values) for e in view.size]
            stride = [evaluate(e, values) for e in view.stride]
            offset = evaluate(view.offset, values) + source.storage_offset()
        except (UnboundedSize, KeyError):
            continue
        outputs[view.output] = source.as_strided(size, stride, offset)
    return outputs
