"""Which graphs give exact results when their runtime-sized dimensions are padded to a bucket.

XLA's dynamic padder makes reductions, matrix products, softmax and elementwise ops ignore the padding past
a dimension's actual size (``dynamic_sizes``). What it cannot fix is a lowering rule that reads a padded
extent as data: a mean that divides by the dimension's static size, a negative index counted from the padded
end, a concatenation along the padded dimension (the padding would land in the middle), random numbers drawn
for the padded shape. This module admits an op on a runtime-sized operand only when it is known to be exact
under padding; any other op makes the whole graph compile per size instead (``first_inexact``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree

from tpucompile import diagnostics
from tpucompile.lowering import dynamic_sizes
from tpucompile.lowering.registry import is_random

aten = torch.ops.aten

_EXACT: set[Any] = {
    # views and copies keep the padding at the end of every dimension
    aten.expand, aten.permute, aten.transpose, aten.t,
    aten.unsqueeze, aten.squeeze, aten.clone, aten._to_copy, aten.alias, aten.detach, aten.lift_fresh_copy,
    aten.contiguous, torch.ops.prims.squeeze,
    # reductions and products: the padder gives the padding the reduction's identity
    aten.sum, aten.amax, aten.amin, aten.max, aten.min, aten.argmax, aten.argmin, aten.any, aten.all,
    aten.prod, aten.logsumexp, aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.dot,
    aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
    # made at the bucket's size and marked with the actual one; iota-based masks count from the start
    aten.arange, aten.full, aten.zeros, aten.ones, aten.empty, aten.empty_strided, aten.new_empty,
    aten.new_zeros, aten.new_ones, aten.new_full, aten.full_like, aten.zeros_like, aten.ones_like,
    aten.empty_like, aten.scalar_tensor, aten.triu, aten.tril,
    # row lookups: each index picks its row whatever the padding holds
    aten.embedding,
}
"""Ops exact under padding whatever their runtime-sized operands (beside pointwise ops, which are tagged)."""


def _dynamic_dims(value: Any, runtime: frozenset[sympy.Symbol]) -> set[int]:
    return {dim for dim, _ in dynamic_sizes.symbolic_dims(value, runtime)} if isinstance(value, torch.Tensor) else set()


def _normalised(dims: Any, rank: int) -> set[int]:
    dims = [dims] if isinstance(dims, int) else list(dims or range(rank))
    return {d % rank if rank else 0 for d in dims}


def _reduced_dims_static(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """mean, var, std: exact only when no reduced dimension is runtime-sized (they divide by its extent)."""
    x = node.args[0].meta["val"]
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if _normalised(dims, x.dim()) & _dynamic_dims(x, runtime):
        return "it divides by the padded extent of a reduced dimension"
    return None


def _normalised_dims_static(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """layer norm and its backward: exact when the normalised (trailing) dimensions are not runtime-sized."""
    x = node.args[1 if node.target is aten.native_layer_norm_backward.default else 0].meta["val"]
    shape = node.args[2 if node.target is aten.native_layer_norm_backward.default else 1]
    normalised = set(range(x.dim() - len(shape), x.dim()))
    if normalised & _dynamic_dims(x, runtime):
        return "it normalises over a padded dimension"
    return None


def _static_start(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """slice, select, narrow: exact along a runtime-sized dimension only from a non-negative constant start."""
    x = node.args[0].meta["val"]
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % max(x.dim(), 1)
    if dim not in _dynamic_dims(x, runtime):
        return None
    start = node.args[2] if len(node.args) > 2 else node.kwargs.get("start", 0)
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    if node.target is aten.slice.Tensor and start is None:
        start = 0
    if not isinstance(start, int) or start < 0 or step not in (1, None):
        return "it indexes a padded dimension from its end or by a size"
    return None


def _along_static(dim_position: int) -> Callable[[torch.fx.Node, frozenset[sympy.Symbol]], str | None]:
    """cat, gather, index_select: exact when the dimension they work along is not runtime-sized."""

    def check(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
        first = node.args[0]
        tensor = (first[0] if isinstance(first, (list, tuple)) else first).meta["val"]
        dim = node.args[dim_position] if len(node.args) > dim_position else node.kwargs.get("dim", 0)
        dim %= max(tensor.dim(), 1)
        tensors = first if isinstance(first, (list, tuple)) else [first]
        if any(dim in _dynamic_dims(t.meta["val"], runtime) for t in tensors):
            return "it works along a padded dimension"
        return None

    return check


RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def reshape_plan(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> tuple[str, Any]:
    """How a view of a runtime-sized tensor stays exact: ("xla", None) when XLA's padder follows it (a
    runtime-sized dimension kept, merged with others, or split with itself outermost), ("split", (input dim,
    output dims)) for the one split XLA gets wrong, a runtime-sized dimension split with itself inside (as
    ``(b * s, n) -> (b, s, n)`` after a matrix product), which the lowering gathers itself; else ("inexact",
    why). Groups are the runs of dimensions whose products match, found with every symbol set to a large
    prime (so products of different symbols never collide)."""
    before, after = node.args[0].meta["val"], node.meta["val"]
    sample = {symbol: 1009 + 2 * k for k, symbol in enumerate(sorted(runtime, key=str))}

    def sizes(shape: Any) -> list[tuple[int, int, bool]]:
        result = []
        for dim, size in enumerate(shape):
            expr = sympy.sympify(size.node.expr) if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
            value = int(expr.xreplace({s: sample.get(s, 1009) for s in expr.free_symbols}))
            if value != 1:
                result.append((dim, value, bool(expr.free_symbols & runtime)))
        return result

    source, target = sizes(before.shape), sizes(after.shape)
    plan: tuple[str, Any] = ("xla", None)
    i = j = 0
    while i < len(source) and j < len(target):
        group_in, group_out = [source[i]], [target[j]]
        product_in, product_out = source[i][1], target[j][1]
        i, j = i + 1, j + 1
        while product_in != product_out:
            if product_in < product_out and i < len(source):
                group_in.append(source[i])
                product_in *= source[i][1]
                i += 1
            elif product_out < product_in and j < len(target):
                group_out.append(target[j])
                product_out *= target[j][1]
                j += 1
            else:
                return "inexact", "it reshapes a padded dimension in a way tpucompile cannot follow"
        flags_in, flags_out = [d for _, _, d in group_in], [d for _, _, d in group_out]
        if sum(flags_in) > 1 or sum(flags_out) > 1:
            return "inexact", "it merges or splits two padded dimensions together"
        if not any(flags_out) or len(group_out) == 1 or flags_out[0]:
            continue
        if len(group_in) != 1 or plan[0] == "split":
            return "inexact", "it splits a padded dimension in a way tpucompile cannot follow"
        plan = ("split", (group_in[0][0], [dim for dim, _, _ in group_out]))
    return plan


def _reshape_keeps_padding(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """view, reshape: exact as ``reshape_plan`` says."""
    kind, detail = reshape_plan(node, runtime)
    return detail if kind == "inexact" else None


def _static_source(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """index with index tensors: exact when the indexed tensor is not runtime-sized (each index, padding
    included, picks a row that exists; the rows picked for the padding are cut away)."""
    if _dynamic_dims(node.args[0].meta["val"], runtime):
        return "it indexes into a padded tensor"
    return None


ZERO_PADDED_OPERAND: dict[Any, int] = {aten.index_put.default: 2}
"""Ops whose operand at the given position the lowering zeroes past its actual sizes (an accumulating
``index_put`` adds every update, padding included, at its index: zeros add nothing)."""


def _accumulates_padding_away(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """index_put: exact when it accumulates into a tensor that is not runtime-sized (the updates' padding is
    zeroed) and its index tensors' runtime sizes are those of the updates."""
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if not accumulate or node.target is not aten.index_put.default:
        return "it writes padded updates in place of values"
    if _dynamic_dims(node.args[0].meta["val"], runtime):
        return "it writes into a padded tensor"
    return None


_CONDITIONAL: dict[Any, Callable[[torch.fx.Node, frozenset[sympy.Symbol]], str | None]] = {
    aten.index: _static_source, aten.index_put: _accumulates_padding_away,
    aten.view: _reshape_keeps_padding, aten._unsafe_view: _reshape_keeps_padding,
    aten.reshape: _reshape_keeps_padding,
    aten.mean: _reduced_dims_static, aten.var: _reduced_dims_static, aten.std: _reduced_dims_static,
    aten.var_mean: _reduced_dims_static,
    aten.native_layer_norm: _normalised_dims_static, aten.native_layer_norm_backward: _normalised_dims_static,
    aten.slice: _static_start, aten.select: _static_start, aten.narrow: _static_start,
    aten.cat: _along_static(1), aten.gather: _along_static(1), aten.index_select: _along_static(1),
}


def _argument_values(node: torch.fx.Node) -> Iterator[Any]:
    """Every value ``node`` takes, nested lists included: a node's traced value, or the literal."""
    for leaf in pytree.tree_leaves((node.args, node.kwargs)):
        yield leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else leaf


def _tensor_operands(node: torch.fx.Node) -> Iterator[torch.Tensor]:
    return (value for value in _argument_values(node) if isinstance(value, torch.Tensor))


def _runtime_scalars(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> bool:
    """Whether a size that depends on a runtime symbol reaches ``node`` as a number."""
    return any(isinstance(value, (torch.SymInt, torch.SymFloat))
               and sympy.sympify(value.node.expr).free_symbols & runtime for value in _argument_values(node))


_SIZE_TAKERS = {aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.arange, aten.full, aten.zeros,
                aten.ones, aten.empty, aten.empty_strided, aten.new_empty, aten.new_zeros, aten.new_ones,
                aten.new_full, aten.slice, aten.narrow}
"""Ops that take runtime sizes as sizes (a bucket's bound gives the padded shape); elsewhere a runtime size
is data, which the bound would get wrong."""


def inexact_reason(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """Why ``node`` would not be exact with its runtime-sized dimensions padded, or None when it would."""
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    if not isinstance(node.meta.get("val"), (torch.Tensor, list, tuple)):
        return None  # size arithmetic: checked where its result is used
    dynamic_operand = any(_dynamic_dims(t, runtime) for t in _tensor_operands(node))
    takes_size = _runtime_scalars(node, runtime)
    if not dynamic_operand and not takes_size:
        return None
    packet = getattr(node.target, "overloadpacket", None)
    if takes_size and packet not in _SIZE_TAKERS:
        return "it takes a runtime size as a number"
    if is_random(node.target):
        return "it draws random numbers for the padded shape"
    if packet in _CONDITIONAL:
        return _CONDITIONAL[packet](node, runtime)
    if packet in _EXACT:
        return None
    if torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return None
    return "XLA's padding of dynamic dimensions is not known to be exact for it"


def _unbounded_size(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """Why a runtime-sized dimension of ``node``'s value has no bound at the bucket, or None."""
    val = node.meta.get("val")
    for item in val if isinstance(val, (list, tuple)) else [val]:
        if isinstance(item, torch.Tensor):
            for _, expr in dynamic_sizes.symbolic_dims(item, runtime):
                try:
                    dynamic_sizes.check_bounded(expr)
                except dynamic_sizes.UnboundedSize as why:
                    return str(why)
    return None


def first_inexact(gm: torch.fx.GraphModule, runtime: frozenset[sympy.Symbol]) -> tuple[torch.fx.Node, str] | None:
    """The first node of ``gm`` that padding would make inexact and why, or None when every node is exact."""
    for node in gm.graph.nodes:
        reason = _unbounded_size(node, runtime) or inexact_reason(node, runtime)
        if reason is not None:
            return node, f"{diagnostics.describe_node(node)}: {reason}"
    return None
