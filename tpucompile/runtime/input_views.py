"""Outputs of a symbolic graph that are views of its inputs, made as views of the actual inputs.

AOTAutograd regenerates an output that aliases an input from that input. With static sizes it replays the
view ops; with symbolic ones it calls ``as_strided`` on the input with the size, stride and offset of the
tensor the compiled graph returned, so that tensor must have the layout eager would give the view (a program
result is a fresh contiguous tensor: ``chunk`` along a later dimension came back with wrong values, ``expand``
raised). The graph's own view ops, replayed on the actual input with the call's sizes, give the view itself.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch

from tpucompile.contracts.size_expressions import UnboundedSize, evaluate


@dataclasses.dataclass(frozen=True)
class InputView:
    """Output ``output`` is argument ``position`` put through the view ops ``steps`` (each an op and its
    arguments after the viewed tensor; sizes in them are expressions over the size symbols)."""

    output: int
    position: int
    steps: tuple[tuple[Any, tuple[Any, ...], dict[str, Any]], ...]


class _TensorArgument(Exception):
    """A view op that takes another tensor: not a view this module replays."""


def _expr(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):  # a size computed in the graph: its traced value
        value = value.meta.get("val")
        if isinstance(value, torch.Tensor) or value is None:
            raise _TensorArgument
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    if isinstance(value, (list, tuple)):
        return type(value)(_expr(v) for v in value)
    return value


def _concrete(value: Any, values: Mapping[sympy.Symbol, int]) -> Any:
    if isinstance(value, sympy.Expr):
        return evaluate(value, values)
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v, values) for v in value)
    return value


def _returns_views(target: Any) -> bool:
    """Whether an op returns views of its first argument (``view``, ``expand``, ``split``, ``unbind``...)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _view_steps(node: Any) -> tuple[torch.fx.Node, list] | None:
    """(the placeholder ``node`` views, the view ops from it to ``node``), or None when ``node`` is not a chain
    of view ops of a placeholder (the traced values of an ATen graph do not say which tensors are views, and
    their strides are those of fresh tensors: the ops say, and replaying them gives eager's layout)."""
    steps = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and (
            node.target is operator.getitem or _returns_views(node.target)):
        try:
            steps.append((node.target, _expr(tuple(node.args[1:])), {k: _expr(v) for k, v in node.kwargs.items()}))
        except _TensorArgument:
            return None
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "placeholder") or not steps:
        return None
    return node, steps[::-1]


def input_views(gm: torch.fx.GraphModule) -> list[InputView]:
    """The outputs of ``gm`` that are views of a placeholder, with the view ops to replay."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = gm.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    views = []
    for index, out in enumerate(outputs):
        found = _view_steps(out)
        if found is not None and isinstance(found[0].meta.get("val"), torch.Tensor):
            views.append(InputView(index, placeholders.index(found[0]), tuple(found[1])))
    return views


def _replay(target: Any, value: torch.Tensor, rest: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor:
    """One view op on the actual tensor. A ``view`` that the actual strides cannot express (a decomposition's
    view after a permute, as in ``channel_shuffle``: the traced tensors had fresh strides) is a ``reshape``,
    which copies: the output then holds the values eager gives, as a tensor of its own."""
    try:
        return target(value, *rest, **kwargs)
    except RuntimeError:
        if target not in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            raise
        return torch.ops.aten.reshape.default(value, *rest, **kwargs)


def replace_views(outputs: list[Any], views: Sequence[InputView], args: Sequence[Any],
                  values: Mapping[sympy.Symbol, int]) -> list[Any]:
    """``outputs`` with each view of an input remade as that view of the actual argument."""
    for view in views:
        value = args[view.position] if view.position < len(args) else None
        if not isinstance(value, torch.Tensor):
            continue
        try:
            for target, rest, kwargs in view.steps:
                if target is operator.getitem:
                    value = value[rest[0]]
                else:
                    value = _replay(target, value, _concrete(rest, values), _concrete(kwargs, values))
        except (UnboundedSize, KeyError):
            continue
        outputs[view.output] = value
    return outputs
