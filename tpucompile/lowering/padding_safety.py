"""Which graphs give exact results when their runtime-sized dimensions are padded to a bucket.

XLA's dynamic padder makes reductions, matrix products, softmax and elementwise ops ignore the padding past
a dimension's actual size (``dynamic_sizes``). What it cannot fix is a lowering rule that reads a padded
extent as data: a mean that divides by the dimension's static size, a negative index counted from the padded
end, a concatenation along the padded dimension (the padding would land in the middle), random numbers drawn
for the padded shape. Some rules read the actual extent instead (``LoweringContext.extent``) and are exact.
This module admits an op on a runtime-sized operand only when it is known to be exact under padding; any
other op makes the whole graph compile per size instead (``first_inexact``).
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
from tpucompile.lowering.registry import is_random, lookup_rule

aten = torch.ops.aten

_EXACT: set[Any] = {
    # views and copies keep the padding at the end of every dimension
    aten.expand, aten.permute, aten.transpose, aten.t,
    aten.unsqueeze, aten.squeeze, aten.clone, aten._to_copy, aten.alias, aten.detach, aten.lift_fresh_copy,
    aten.contiguous, torch.ops.prims.squeeze, aten.copy,
    # reductions and products: the padder gives the padding the reduction's identity
    aten.sum, aten.amax, aten.amin, aten.max, aten.min, aten.argmax, aten.argmin, aten.any, aten.all,
    aten.prod, aten.logsumexp, aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.dot, aten.linalg_vector_norm,
    aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
    # made at the bucket's size and marked with the actual one; iota-based masks count from the start
    aten.arange, aten.full, aten.zeros, aten.ones, aten.empty, aten.empty_strided, aten.new_empty,
    aten.new_empty_strided,
    aten.new_zeros, aten.new_ones, aten.new_full, aten.full_like, aten.zeros_like, aten.ones_like,
    aten.empty_like, aten.empty_permuted, aten.scalar_tensor, aten.triu, aten.tril,
    # row lookups: each index picks its row whatever the padding holds
    aten.embedding,
    # their lowerings count by the actual sizes (``LoweringContext.extent``): a mean's divisor, topk's
    # padding sorted last; XLA's dynamic padder concatenates and sorts by the actual sizes itself
    aten.mean, aten.var, aten.std, aten.var_mean, aten.topk, aten.cat, aten.sort, aten.native_layer_norm,
    # prefix scans: each position combines only the positions before it, and the padding comes after
    aten.cumsum, aten.cumprod, aten.logcumsumexp, aten.cummax, aten.cummin,
    # XLA's dynamic padder reverses the actual elements only
    aten.flip,
    # element-wise scatters: their lowerings send the padding's updates out of range, where XLA drops them
    aten.scatter, aten.scatter_add, aten.scatter_reduce,
    # reads at indices torch requires to be in range: only actual elements are read
    aten.gather, aten.index_select,
    # complex numbers taken apart and put together element by element (a pair's trailing 2 is never padded)
    aten.view_as_real, aten.view_as_complex, aten.polar, aten.complex, aten.real, aten.imag, aten._conj,
    aten._neg_view, aten.resolve_conj, aten.resolve_neg,
}
"""Ops exact under padding whatever their runtime-sized operands (beside pointwise ops, which are tagged)."""


def _dynamic_dims(value: Any, runtime: frozenset[sympy.Symbol]) -> set[int]:
    return {dim for dim, _ in dynamic_sizes.symbolic_dims(value, runtime)} if isinstance(value, torch.Tensor) else set()


def _constant_start(first: int) -> Callable[[torch.fx.Node, frozenset[sympy.Symbol]], str | None]:
    """slice, select, narrow and their scatters (whose ``dim, start, ..., step`` begin at argument ``first``):
    exact along a runtime-sized dimension from a constant start, with step 1. A start counted from the end
    (negative) is counted from the actual end by the slice and select lowerings, when the result's own
    extent along the dimension is fixed."""

    def check(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
        x = node.args[0].meta["val"]
        dim = (node.args[first] if len(node.args) > first else node.kwargs.get("dim", 0)) % max(x.dim(), 1)
        if dim not in _dynamic_dims(x, runtime):
            return None
        start = node.args[first + 1] if len(node.args) > first + 1 else node.kwargs.get(
            "index" if node.target in _SELECTS else "start", 0)
        step = node.args[first + 3] if len(node.args) > first + 3 else node.kwargs.get("step", 1)
        start = 0 if start is None else start
        start = start.meta.get("val") if isinstance(start, torch.fx.Node) else start
        if isinstance(start, torch.SymInt) and node.target is aten.slice.Tensor and step in (1, None):
            return _runtime_start_reason(node, runtime, dim, start)
        if not isinstance(start, int) or step not in (1, None):
            return "it indexes a padded dimension by a size or with a step"
        if start < 0:
            if node.target not in _FROM_ACTUAL_END:
                return "it indexes a padded dimension from its end"
            window = node.args[1] if node.target is aten.slice_scatter.default else node
            if node.target in _SLICES and dim in _dynamic_dims(window.meta["val"], runtime):
                return "it takes a runtime-sized slice from the end of a padded dimension"
        return None

    return check


def _runtime_start_reason(node: torch.fx.Node, runtime: frozenset[sympy.Symbol], dim: int,
                          start: torch.SymInt) -> str | None:
    """slice from a start computed from runtime sizes (the backward of a concatenation): its lowering takes
    a window of the result's bucket size from the actual start, exact when the window's extent is fixed or
    the slice runs to the operand's end (the window then ends within the operand's bucket)."""
    result_dims = dict(dynamic_sizes.symbolic_dims(node.meta["val"], runtime))
    if dim not in result_dims:
        return None
    operand = dict(dynamic_sizes.symbolic_dims(node.args[0].meta["val"], runtime))[dim]
    if sympy.simplify(sympy.sympify(start.node.expr) + result_dims[dim] - operand) == 0:
        return None
    return "it takes a runtime-sized slice from a runtime start that may not run to the end"


_SELECTS = frozenset({aten.select.int, aten.select_scatter.default})
_SLICES = frozenset({aten.slice.Tensor, aten.slice_scatter.default})
_FROM_ACTUAL_END = frozenset({aten.slice.Tensor, aten.select.int, aten.slice_scatter.default,
                              aten.select_scatter.default})
"""Lowerings that count a negative start from the actual end of a padded dimension."""


def _constant_splits(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """split, split_with_sizes, unbind: exact along a static dimension, and along a runtime-sized one when every
    piece but the last has a constant size (so every piece starts at a constant, like a slice)."""
    x = node.args[0].meta["val"]
    unbinds = node.target is aten.unbind.int
    position = 1 if unbinds else 2
    dim = (node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)) % max(x.dim(), 1)
    if dim not in _dynamic_dims(x, runtime):
        return None
    if unbinds:
        return "it unbinds a padded dimension"
    sizes = node.args[1]
    starts = sizes[:-1] if isinstance(sizes, (list, tuple)) else [sizes]
    if not all(isinstance(size, int) for size in starts):
        return "it splits a padded dimension at runtime sizes"
    return None


def _constant_pads(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """constant_pad_nd: exact with constant pads (its lowering fills from the actual end of a runtime-sized
    dimension; cropping keeps the actual elements first)."""
    x = node.args[0].meta["val"]
    dynamic = _dynamic_dims(x, runtime)
    pads = list(node.args[1])
    for i in range(len(pads) // 2):
        if x.dim() - 1 - i in dynamic and not all(isinstance(p, int) for p in pads[2 * i: 2 * i + 2]):
            return "it pads a padded dimension by a runtime size"
    return None


WINDOWS = {aten.slice.Tensor: 1, aten.slice_copy.Tensor: 1, aten.split.Tensor: 2, aten.split_copy.Tensor: 2,
           aten.split_with_sizes.default: 2, aten.split_with_sizes_copy.default: 2}
"""Ops that cut windows out of a dimension (the position of their ``dim`` argument): a window of fixed extent
cut from a runtime-sized dimension is runtime-sized to XLA (``graph._fixed_windows``)."""

RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def reshape_plan(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> tuple[str, Any]:
    """How a view of a runtime-sized tensor stays exact: ("xla", None) when XLA's padder follows it (a
    runtime-sized dimension kept or merged with others), ("split", (input dim, output dims)) for the split XLA
    gets wrong, a runtime-sized dimension split with itself inside (as ``(b * s, n) -> (b, s, n)`` after a
    matrix product), which the lowering gathers itself; ("outer-split", input dim) for one split with itself
    outermost (``(2 * s, n) -> (s, 2, n)``), or regrouped with itself outermost on both sides
    (``(s, 8, 8) -> (2 * s, 32)``), whose actual elements are a prefix: the lowering reshapes it in a
    fixed shape, since XLA's padder, following the size back through a product, aborts the process on some
    (``dynamic_sizes.fixed_shape``); else ("inexact", why). Groups are the runs of dimensions whose products
    match, found with every symbol set to a large prime (so products of different symbols never collide)."""
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
        if flags_out and flags_out[0] and len(group_in) == 1 and len(group_out) > 1 and plan[0] == "xla":
            plan = ("outer-split", group_in[0][0])
            continue
        if flags_in[0] and flags_out[0] and len(group_in) > 1 and len(group_out) > 1:
            # regrouped with itself outermost on both sides (``(s, 8, 8) -> (2 * s, 32)``, a head split inside
            # ``nn.MultiheadAttention``): the actual elements are a prefix, as in an outer split; XLA's padder
            # refuses a reshape that both splits and merges around a dynamic dimension
            if plan[0] != "xla":
                return "inexact", "it regroups a padded dimension in a way tpucompile cannot follow"
            plan = ("outer-split", group_in[0][0])
            continue
        if not any(flags_out) or len(group_out) == 1 or flags_out[0]:
            continue
        if len(group_in) != 1 or plan[0] != "xla":
            return "inexact", "it splits a padded dimension in a way tpucompile cannot follow"
        plan = ("split", (group_in[0][0], [dim for dim, _, _ in group_out]))
    return plan


def _reshape_keeps_padding(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """view, reshape: exact as ``reshape_plan`` says."""
    kind, detail = reshape_plan(node, runtime)
    return detail if kind == "inexact" else None


def _integer_indices(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """index and index_put with index tensors: exact with integer indices. Each index of an actual position is
    in range of the unpadded tensor (torch checks it) and so addresses an actual element; a negative one counts
    from the actual end (the lowering wraps it by the actual extent). What ``index`` picks for the padding is
    cut away; ``index_put``'s lowering sends the indices in an index tensor's padding out of range, so the
    updates they would place are dropped, and an update's padding along a dim it is not indexed by lands in
    the target's padding of that dim. A boolean mask picks by its padding too, so it is exact only when
    nothing it reads is padded."""
    masks = [i for i in node.args[1] if i is not None and i.meta["val"].dtype in (torch.bool, torch.uint8)]
    if masks and any(_dynamic_dims(value.meta["val"], runtime) for value in [node.args[0], *masks]):
        return "it selects by a boolean mask over a padded dimension"
    return None


def _along_one_dim(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """median, nanmedian and kthvalue along a dim: exact (their lowerings sort the padding last and count the
    actual row); of all elements, a padded operand would be flattened with its padding inside."""
    if node.target in (aten.median.default, aten.nanmedian.default):
        return "it flattens a padded tensor"
    return None


def _transformed_dims_static(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """FFTs: exact when no transformed dimension is runtime-sized (each other index is its own transform)."""
    x = node.args[0].meta["val"]
    transformed = {d % x.dim() for d in node.args[1]}
    if transformed & _dynamic_dims(x, runtime):
        return "it transforms over a padded dimension"
    return None


_CONDITIONAL: dict[Any, Callable[[torch.fx.Node, frozenset[sympy.Symbol]], str | None]] = {
    aten.index: _integer_indices, aten.index_put: _integer_indices,
    aten.view: _reshape_keeps_padding, aten._unsafe_view: _reshape_keeps_padding,
    aten.reshape: _reshape_keeps_padding,
    aten.slice: _constant_start(1), aten.select: _constant_start(1), aten.narrow: _constant_start(1),
    aten.slice_scatter: _constant_start(2), aten.select_scatter: _constant_start(2),
    aten.constant_pad_nd: _constant_pads,
    aten.split: _constant_splits, aten.split_with_sizes: _constant_splits, aten.unbind: _constant_splits,
    aten._fft_c2c: _transformed_dims_static, aten._fft_r2c: _transformed_dims_static,
    aten._fft_c2r: _transformed_dims_static,
    aten.median: _along_one_dim, aten.nanmedian: _along_one_dim, aten.kthvalue: _along_one_dim,
}


def _argument_values(node: torch.fx.Node) -> Iterator[Any]:
    """Every value ``node`` takes, nested lists included: a node's traced value, or the literal."""
    for leaf in pytree.tree_leaves((node.args, node.kwargs)):
        yield leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else leaf


def _tensor_operands(node: torch.fx.Node) -> Iterator[torch.Tensor]:
    return (value for value in _argument_values(node) if isinstance(value, torch.Tensor))


def _runtime_numbers(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> list[tuple[int | None, sympy.Expr]]:
    """(positional argument, expression) of each number ``node`` takes that depends on a runtime symbol (the
    position is None for one nested in a list or passed by keyword)."""
    found = []
    for position, arg in enumerate(node.args):
        for leaf in pytree.tree_leaves(arg):
            value = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else leaf
            if isinstance(value, (torch.SymInt, torch.SymFloat)):
                expr = sympy.sympify(value.node.expr)
                if expr.free_symbols & runtime:
                    found.append((position if leaf is arg else None, expr))
    for leaf in pytree.tree_leaves(node.kwargs):
        value = leaf.meta.get("val") if isinstance(leaf, torch.fx.Node) else leaf
        if isinstance(value, (torch.SymInt, torch.SymFloat)) and sympy.sympify(value.node.expr).free_symbols & runtime:
            found.append((None, sympy.sympify(value.node.expr)))
    return found


_SIZE_TAKERS = {aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.zeros, aten.ones, aten.empty,
                aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.new_zeros, aten.new_ones,
                aten.split_with_sizes, aten.native_layer_norm}
"""Ops that take runtime sizes only as sizes (a bucket's bound gives the padded shape; layer norm's normalised
shape is the trailing shape of its input; strides are a layout XLA chooses itself)."""

_DATA_POSITIONS: dict[Any, frozenset[int]] = {
    aten.full: frozenset({1}), aten.full_like: frozenset({1}), aten.scalar_tensor: frozenset({0}),
    aten.arange: frozenset({0, 2}), aten.slice: frozenset({2}),
}
"""Ops that take sizes as sizes and, at these positions, runtime numbers as data, which their lowerings
compute when the program runs (``LoweringContext.runtime_scalars``)."""


def _runtime_numbers_reason(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """Why the runtime-dependent numbers ``node`` takes would make it inexact, or None."""
    packet = getattr(node.target, "overloadpacket", None)
    numbers = _runtime_numbers(node, runtime)
    if packet in _SIZE_TAKERS:
        return None
    if packet is aten.arange and node.target is aten.arange.default:
        return None  # arange(end): the end is a size
    if packet in _DATA_POSITIONS:
        data = [expr for position, expr in numbers if position in _DATA_POSITIONS[packet]]
    elif torch.Tag.pointwise in getattr(node.target, "tags", ()) and getattr(lookup_rule(node.target), "promote",
                                                                            None) is not None:
        data = [expr for _, expr in numbers]
        if any(position is None for position, _ in numbers):
            return "it takes a runtime size as a number in a list or by keyword"
    else:
        return "it takes a runtime size as a number"
    for expr in data:
        if not dynamic_sizes.computable(expr):
            return f"it takes a runtime size as a number computed in a way tpucompile cannot follow ({expr})"
    return None


def takes_runtime_sizes(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> bool:
    """Whether ``node`` takes a tensor with a runtime-sized dimension or a number that depends on a runtime
    symbol."""
    return any(_dynamic_dims(t, runtime) for t in _tensor_operands(node)) or bool(_runtime_numbers(node, runtime))


def inexact_reason(node: torch.fx.Node, runtime: frozenset[sympy.Symbol]) -> str | None:
    """Why ``node`` would not be exact with its runtime-sized dimensions padded, or None when it would."""
    if node.op != "call_function" or node.target is operator.getitem:
        return None
    if not isinstance(node.meta.get("val"), (torch.Tensor, list, tuple)):
        return None  # size arithmetic: checked where its result is used
    dynamic_operand = any(_dynamic_dims(t, runtime) for t in _tensor_operands(node))
    takes_size = bool(_runtime_numbers(node, runtime))
    if not dynamic_operand and not takes_size:
        return None
    packet = getattr(node.target, "overloadpacket", None)
    if takes_size:
        reason = _runtime_numbers_reason(node, runtime)
        if reason is not None:
            return reason
    if is_random(node.target):
        return None  # an independent draw per element (rules/random.py): the padding's draws are never read
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
