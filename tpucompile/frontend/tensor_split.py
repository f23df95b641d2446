"""Which mesh axes split each value of an ATen graph, per dimension, for the activation budget's estimate.

The estimate (``activation_budget``) counts each value's bytes per chip, so it must know how a sharding plan
splits the values the graph computes, not only its inputs. Under tensor parallelism a column-parallel
product's result is split along its columns (the MLP's [tokens, hidden] intermediates, the heads) as well as
along the batch, and a row-parallel product contracts the column split away. A weight's gradient contracts
the batch, so it is whole across the data axis until it is reduce-scattered, and a layer's weights are
gathered whole across it for the layer's products. Counted by the batch's split alone, a 405B-shaped plan over
``model=8`` estimated 184 GiB per chip where XLA's larger program peaked at 54.

``value_splits`` follows the inputs' splits through the graph as XLA's propagation would for the ops a
transformer is made of: elementwise ops keep the splits of the dimensions they keep, reductions drop those of
the dimensions they reduce, views and permutations move them with their dimensions, a product keeps its
operands' splits on the dimensions it does not contract, an index lookup takes its indices' split, and a
loop's body is walked with its inputs' splits. An axis splits one dimension at most: where two operands split
different dimensions of a result by the same axis (a batch-split activation times an FSDP-split weight), the
first dimension keeps it, as XLA gathers the weight. An op this module does not know keeps the split of an
operand of its shape, or none: a value counted whole errs toward fitting, never past the chip.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from tpucompile.contracts.loop_ops import body_of, is_loop, loop_parts
from tpucompile.passes.noop_views import is_view

Split = tuple[frozenset[str], ...]
"""Per dimension of a value, the mesh axes that split it (empty: whole along it)."""

_WHOLE: frozenset[str] = frozenset()

_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.view_copy.default,
          torch.ops.aten.reshape.default}
_PERMUTES = {torch.ops.aten.permute.default, torch.ops.aten.permute_copy.default}
_TRANSPOSES = {torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.t_copy.default,
               torch.ops.aten.transpose_copy.int}
_UNSQUEEZES = {torch.ops.aten.unsqueeze.default, torch.ops.aten.unsqueeze_copy.default}
_SELECTS = {torch.ops.aten.select.int, torch.ops.aten.select_copy.int}
_REDUCTIONS = {torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim, torch.ops.aten.amax.default,
               torch.ops.aten.amin.default, torch.ops.aten.prod.dim_int}
_SCATTERS = {torch.ops.aten.select_scatter.default, torch.ops.aten.slice_scatter.default}
CONVERSIONS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}
"""Ops that only change a value's dtype."""
_SHAPE_KEEPING = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default,
                  torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.expand.default,
                  torch.ops.aten.slice.Tensor, torch.ops.aten.slice_copy.Tensor}


def value_splits(gm: torch.fx.GraphModule, axis_sizes: Mapping[str, int],
                 placeholder_split: Callable[[torch.fx.Node], Split | None],
                 output_splits: Sequence[Split | None] = ()) -> dict[torch.fx.Node, Split]:
    """Each tensor value of ``gm`` (and of its loops' bodies) and the mesh axes that split it;
    ``placeholder_split`` gives an input's (None: whole), ``output_splits[i]`` how the program returns its
    output i (``lay_out_outputs``). A tuple-valued node maps to nothing; its elements are found at their
    ``getitem``."""
    if not axis_sizes:  # no mesh: every value whole
        return {}
    return _Walk(axis_sizes).graph(gm, placeholder_split, output_splits)


def divisor(split: Split | None, axis_sizes: Mapping[str, int]) -> int:
    """How many chips share a value split so."""
    return math.prod(axis_sizes[axis] for dim in split or () for axis in dim)


class _Walk:
    def __init__(self, axis_sizes: Mapping[str, int]) -> None:
        self.axis_sizes = axis_sizes
        self.splits: dict[torch.fx.Node, Split] = {}

    def graph(self, gm: torch.fx.GraphModule, placeholder_split: Callable[[torch.fx.Node], Split | None],
              output_splits: Sequence[Split | None] = ()) -> dict[torch.fx.Node, Split]:
        splits = self.splits
        tuples: dict[torch.fx.Node, list[Split | None]] = {}
        created = []
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder":
                if isinstance(val, torch.Tensor):
                    splits[node] = _fitted(placeholder_split(node), val)
            elif node.op != "call_function":
                continue
            elif node.target is operator.getitem and node.args[0] in tuples:
                if isinstance(val, torch.Tensor):
                    splits[node] = _fitted(tuples[node.args[0]][node.args[1]], val)
            elif is_loop(node):
                tuples[node] = self.loop(node)
            elif isinstance(val, torch.Tensor):
                try:
                    splits[node] = _distinct(self.op(node, val))
                except (IndexError, TypeError, ValueError, ZeroDivisionError):  # an overload whose arguments the
                    splits[node] = _whole(val)  # rules do not read as they expect: counted whole, toward fitting
                if not node.all_input_nodes:
                    created.append(node)
            elif isinstance(val, (tuple, list)):
                tuples[node] = [self.same_shape(node, v) if isinstance(v, torch.Tensor) else None for v in val]
        _lay_out_outputs(gm, splits, output_splits)
        for node in created:  # a filled tensor (the zeros a gradient is scattered into): split as what reads it
            splits[node] = self.same_shape_among(node.users, node.meta["val"], splits[node])
        return splits

    def op(self, node: torch.fx.Node, val: torch.Tensor) -> Split:
        target, args, splits = node.target, node.args, self.splits
        source = args[0] if args and isinstance(args[0], torch.fx.Node) else None
        have = splits.get(source) if source is not None else None
        if have:  # rules that name the first operand's dimensions (a single number has none to name)
            if target in _VIEWS:
                return self.regroup(traced_shape(source.meta["val"]), have, traced_shape(val))
            if target in _PERMUTES:
                return tuple(have[d % len(have)] for d in args[1])
            if target in _TRANSPOSES:
                first, second = (1, 0) if len(args) < 3 else (args[1] % len(have), args[2] % len(have))
                swapped = list(have)
                swapped[first], swapped[second] = have[second], have[first]
                return tuple(swapped)
            if target in _UNSQUEEZES:
                at = args[1] % (len(have) + 1)
                return (*have[:at], _WHOLE, *have[at:])
            if target in _SELECTS:
                at = args[1] % len(have)
                return (*have[:at], *have[at + 1:])
            if target is torch.ops.aten.mm.default and (other := splits.get(args[1])) is not None:
                return (have[0], other[1])
            if target is torch.ops.aten.bmm.default and (other := splits.get(args[1])) is not None:
                return (have[0] | other[0], have[1], other[2])
            if target in _REDUCTIONS:
                dims = args[1] if len(args) > 1 else node.kwargs.get("dim")
                keepdim = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
                return _reduced(have, [dims] if isinstance(dims, int) else dims, bool(keepdim), val.dim())
            if target is torch.ops.aten.index.Tensor:
                return self.lookup(node, have, val)
            if target is torch.ops.aten.index_put.default:
                return have
        if target in _SCATTERS and len(args) > 2 and isinstance(args[1], torch.fx.Node) and args[1] in splits:
            placed = splits[args[1]]
            if target is torch.ops.aten.select_scatter.default:
                at = args[2] % val.dim()
                placed = (*placed[:at], _WHOLE, *placed[at:])
            own = have or _whole(val)
            return tuple(a | b for a, b in zip(own, placed, strict=True)) if len(placed) == val.dim() else own
        if target is torch.ops.aten.cat.default:
            parts = [splits.get(part) for part in args[0]]
            if parts and all(part is not None and len(part) == val.dim() for part in parts):
                return tuple(frozenset.intersection(*dims) for dims in zip(*parts, strict=True))
            return _whole(val)
        if target in _SHAPE_KEEPING or torch.Tag.pointwise in getattr(target, "tags", ()):
            return self.broadcast(node, val)
        return self.same_shape(node, val)

    def broadcast(self, node: torch.fx.Node, val: torch.Tensor) -> Split:
        """An elementwise result: each dimension split as the operands' dimensions it lines up with (from the
        right, as broadcasting lines them up) are, where they have its size."""
        out = [_WHOLE] * val.dim()
        shape = traced_shape(val)
        for operand in node.all_input_nodes:
            have = self.splits.get(operand)
            if have is None:
                continue
            operand_shape = traced_shape(operand.meta["val"])
            for offset in range(1, min(len(have), len(out)) + 1):
                if operand_shape[-offset] == shape[-offset]:
                    out[-offset] = out[-offset] | have[-offset]
        return tuple(out)

    def same_shape(self, node: torch.fx.Node, val: torch.Tensor) -> Split:
        """An op this module does not know: split as the most split operand of its shape (an attention
        kernel's output is its query's), else whole."""
        return self.same_shape_among(node.all_input_nodes, val, _whole(val))

    def same_shape_among(self, nodes: Iterable[torch.fx.Node], val: torch.Tensor, otherwise: Split) -> Split:
        """The most split of ``nodes`` of ``val``'s shape, or, failing any, whose leading dimensions are its
        shape (an attention kernel's row statistics, [batch, heads, tokens] of its query): that split, or
        ``otherwise``."""
        shape = traced_shape(val)
        found = []
        for other in nodes:
            have = self.splits.get(other)
            other_shape = traced_shape(other.meta["val"]) if isinstance(other.meta.get("val"), torch.Tensor) else None
            if have is not None and other_shape is not None and other_shape[:len(shape)] == shape:
                found.append((other_shape == shape, divisor(have[:len(shape)], self.axis_sizes), have[:len(shape)]))
        return max(found, key=lambda item: item[:2])[2] if found else otherwise

    def lookup(self, node: torch.fx.Node, table: Split, val: torch.Tensor) -> Split:
        """``table[indices]`` with one index tensor on the first dimension (an embedding): the indices' split,
        then the table's other dimensions'."""
        indices = node.args[1]
        if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node) or indices[0] not in self.splits:
            return self.same_shape(node, val)
        split = (*self.splits[indices[0]], *table[1:])
        return split if len(split) == val.dim() else _whole(val)

    def regroup(self, before: tuple[int, ...], split: Split, after: tuple[int, ...]) -> Split:
        """A view's split: the dimensions before and after are matched in groups of equal products; a group's
        axes go to the first dimension of the group after it that they divide, the way a merged
        [tokens, heads x dim] splits its heads when taken apart again."""
        out = [_WHOLE] * len(after)
        i = j = 0
        while i < len(before) and j < len(after):
            group_i, group_j = [i], [j]
            size_i, size_j = before[i], after[j]
            while size_i != size_j:
                if size_i < size_j and i + 1 < len(before):
                    i += 1
                    group_i.append(i)
                    size_i *= before[i]
                elif j + 1 < len(after):
                    j += 1
                    group_j.append(j)
                    size_j *= after[j]
                else:
                    return tuple(out)
            axes = frozenset().union(*(split[k] for k in group_i))
            factor = math.prod(self.axis_sizes[axis] for axis in axes)
            if axes:
                for k in group_j:
                    if after[k] % factor == 0:
                        out[k] = axes
                        break
            i, j = i + 1, j + 1
        return tuple(out)

    def loop(self, node: torch.fx.Node) -> list[Split | None]:
        """A loop's results: its body walked with the carries' and shared values' splits and each stacked
        input's split without its layer axis; carries come out as the body returns them, stacked results with
        a whole layer axis in front."""
        _, init, xs, shared, _, _ = loop_parts(node)
        body = body_of(node)

        def inner(value: Any, drop_layer_axis: bool) -> Split | None:
            have = self.splits.get(value) if isinstance(value, torch.fx.Node) else None
            return None if have is None else (have[1:] if drop_layer_axis else have)

        entries = [inner(v, False) for v in init] + [inner(v, True) for v in xs] + [inner(v, False) for v in shared]
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        given = dict(zip(placeholders, entries, strict=False))
        self.graph(body, given.get)
        returned = body.graph.output_node().args[0]
        returned = list(returned) if isinstance(returned, (list, tuple)) else [returned]
        results: list[Split | None] = []
        for index, value in enumerate(returned):
            have = self.splits.get(value) if isinstance(value, torch.fx.Node) else None
            results.append(have if index < len(init) or have is None else (_WHOLE, *have))
        return results


def traced_shape(val: torch.Tensor) -> tuple[int, ...]:
    """A traced value's sizes as numbers, a symbolic size at its hint (1 without one): read without adding
    guards to the trace (a graph with changing sizes is estimated at the sizes it was traced with)."""
    return tuple(int(size.node.hint) if isinstance(size, torch.SymInt) and size.node.hint is not None
                 else 1 if isinstance(size, torch.SymInt) else int(size) for size in val.shape)


def traced_bytes(value: Any) -> int:
    """Bytes of a traced tensor at its traced sizes (``traced_shape``); 0 for anything else (a tuple result holds
    nothing of its own: its elements are counted where they are taken out of it)."""
    if not isinstance(value, torch.Tensor):
        return 0
    return math.prod(traced_shape(value)) * value.element_size()


def _whole(val: torch.Tensor) -> Split:
    return (_WHOLE,) * val.dim()


def _fitted(split: Split | None, val: torch.Tensor) -> Split:
    return split if split is not None and len(split) == val.dim() else _whole(val)


def _distinct(split: Iterable[frozenset[str]]) -> Split:
    """``split`` with each axis kept on its first dimension only (an axis splits one dimension at most)."""
    seen: set[str] = set()
    out = []
    for axes in split:
        out.append(frozenset(axes - seen))
        seen |= axes
    return tuple(out)


def _reduced(have: Split, dims: Sequence[int] | None, keepdim: bool, rank: int) -> Split:
    reduced = set(range(len(have))) if not dims else {d % len(have) for d in dims}
    kept = tuple(_WHOLE if d in reduced else s for d, s in enumerate(have) if keepdim or d not in reduced)
    return kept if len(kept) == rank else (_WHOLE,) * rank


def _lay_out_outputs(gm: torch.fx.GraphModule, splits: dict[torch.fx.Node, Split],
                    output_splits: Sequence[Split | None]) -> None:
    """Give ``gm``'s outputs the splits the program returns them with (``output_splits[i]`` for output i, None:
    as found), and the same to the values they are views or conversions of, as XLA's propagation carries an
    output's layout back to where it is made: a backward's gradients leave it laid out as their parameters
    (reduce-scattered where they are made; an embedding's scattered into its own split table), and a loop's
    stacked gradients, cut into one gradient per layer, are split as those gradients with a whole layer axis."""
    returned = gm.graph.output_node().args[0]
    returned = list(returned) if isinstance(returned, (list, tuple)) else [returned]
    for value, split in zip(returned, output_splits, strict=False):
        if not (isinstance(value, torch.fx.Node) and split is not None
                and isinstance(value.meta.get("val"), torch.Tensor)):
            continue
        shape = traced_shape(value.meta["val"])
        if len(split) != len(shape):
            continue
        while True:
            splits[value] = split
            base = value.args[0] if value.op == "call_function" and value.args else None
            if not ((is_view(value) or value.target in CONVERSIONS) and isinstance(base, torch.fx.Node)
                    and isinstance(base.meta.get("val"), torch.Tensor)):
                break
            base_shape = traced_shape(base.meta["val"])
            if len(base_shape) == len(shape) + 1 and base_shape[1:] == shape:
                split = (_WHOLE, *split)  # a layer cut from a stack
            elif len(base_shape) != len(shape):
                break
            value, shape = base, base_shape


def gathered_updates(node: torch.fx.Node, splits: Mapping[torch.fx.Node, Split], axis_sizes: Mapping[str, int]
                     ) -> int:
    """Bytes per chip an ``index_put`` holds beyond its result when its updates are split by an axis that also
    splits the tensor they are scattered into (an embedding's gradient: tokens split by the batch, the table
    by FSDP). XLA gathers across that axis whichever is smaller: the updates (4 GiB per chip in a 405B-shaped
    plan's backward), or else it scatters into the table whole, holding the filled table and the scattered
    one at once (2 x 2 GiB in an 8B-shaped plan's; both from XLA's buffer assignment)."""
    if node.target is not torch.ops.aten.index_put.default or len(node.args) < 3:
        return 0
    values = node.args[2]
    if not isinstance(values, torch.fx.Node) or values not in splits or node not in splits:
        return 0
    shared = frozenset().union(*splits[node]) & frozenset().union(*splits[values])
    if not shared:
        return 0
    updates = _bytes_across(values, splits[values], shared, axis_sizes)
    table = _bytes_across(node, splits[node], shared, axis_sizes)
    return updates if updates <= table else 2 * table


def _bytes_across(node: torch.fx.Node, split: Split, gathered: frozenset[str], axis_sizes: Mapping[str, int]) -> int:
    """Bytes per chip of ``node`` gathered whole across the axes ``gathered``."""
    return traced_bytes(node.meta["val"]) // divisor(tuple(axes - gathered for axes in split), axis_sizes)
