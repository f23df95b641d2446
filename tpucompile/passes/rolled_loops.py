"""Tidy the loops of rolled layers in AOTAutograd's joint graph, before it is split into forward and backward.

PyTorch differentiates a ``scan`` by partitioning one iteration's joint graph: the forward loop also returns,
stacked per iteration, every value the backward loop reads, and the backward loop walks those stacks in
reverse through ``flip``. Two of its habits cost a copy of whole stacks on every step:

* it stacks values that are only a layer's own parameter seen again (a weight transposed twice, for the
  backward's product) or a value every iteration shares (a rotary table): the forward writes a second copy
  of every weight, or one copy of the table per layer, and saves it for the backward. Such a result is
  replaced by the stack it repeats (the stacked parameters the loop already reads) or by the shared value
  broadcast along the layers, and dropped from the loop;
* the flips copy each stack once more (and the partitioner then computes them in the forward, where they
  are saved flipped). They are folded into the loop (``contracts.loop_ops.scan_in_reverse``), which reads
  and writes those stacks back to front by its index.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from tpucompile.contracts.loop_ops import SCAN, body_of, loop_parts, scan_in_reverse

aten = torch.ops.aten

_PERMUTES = {aten.permute.default, aten.permute_copy.default}
_TRANSPOSES = {aten.t.default, aten.t_copy.default, aten.transpose.int, aten.transpose_copy.int}
_SAME_VALUE = {aten.clone.default, aten.alias.default, aten.alias_copy.default, aten.detach.default,
               aten.detach_copy.default, aten.view.default, aten.view_copy.default, aten._unsafe_view.default,
               aten.reshape.default}


def tidy_rolled_loops(gm: torch.fx.GraphModule) -> int:
    """Apply both rewrites to every loop of ``gm``; returns how many stacks no longer need a copy."""
    saved = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SCAN]:
        saved += _drop_repeated_results(gm, node)
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SCAN]:
        saved += _fold_flips(gm, node)
    if saved:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return saved


def _drop_repeated_results(gm: torch.fx.GraphModule, loop: torch.fx.Node) -> int:
    """Replace each stacked result of ``loop`` that repeats a stacked input or a shared value (through
    transposes that cancel and copies) by that stack, or by the shared value broadcast along the layers,
    and drop it from the loop's body."""
    body = body_of(loop)
    _, init, xs, shared, _, _ = loop_parts(loop)
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    output = body.graph.output_node()
    results = list(output.args[0])
    carried = len(init)
    getitems = {u.args[1]: u for u in loop.users if u.target is operator.getitem}
    length = loop.meta["val"][carried].shape[0] if len(results) > carried else None
    dropped: list[int] = []
    for position in range(carried, len(results)):
        source = _repeated_placeholder(results[position])
        if source is None or position not in getitems:
            continue
        k = placeholders.index(source)
        stacked_value = getitems[position].meta["val"]
        if carried <= k < carried + len(xs):
            replacement = xs[k - carried]
            if tuple(replacement.meta["val"].shape) != tuple(stacked_value.shape):
                continue
        elif k >= carried + len(xs):
            value = shared[k - carried - len(xs)]
            with gm.graph.inserting_after(getitems[position]):
                lifted = gm.graph.call_function(aten.unsqueeze.default, (value, 0))
                lifted.meta["val"] = value.meta["val"].unsqueeze(0)
            with gm.graph.inserting_after(lifted):
                replacement = gm.graph.call_function(aten.expand.default, (lifted, [length, *value.meta["val"].shape]))
                replacement.meta["val"] = lifted.meta["val"].expand(length, *value.meta["val"].shape)
        else:
            continue  # the carry as it entered the iteration: a value of its own per layer
        getitems[position].replace_all_uses_with(replacement)
        dropped.append(position)
    if not dropped:
        return 0
    kept = [p for p in range(len(results)) if p not in dropped]
    output.args = (type(output.args[0])(results[p] for p in kept),)
    body.graph.eliminate_dead_code()
    body.recompile()
    loop.meta["val"] = [loop.meta["val"][p] for p in kept]
    for position, getitem in getitems.items():
        if position in dropped:
            gm.graph.erase_node(getitem)
        else:
            getitem.args = (loop, kept.index(position))
    return len(dropped)


def _repeated_placeholder(node: Any) -> torch.fx.Node | None:
    """The body input that ``node`` is, element for element, through copies and transposes that cancel;
    None when it is anything else."""
    permutation: list[int] | None = None
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        value = node.meta.get("val")
        source = node.args[0] if node.args else None
        if not isinstance(source, torch.fx.Node) or not isinstance(value, torch.Tensor):
            return None
        if node.target in _SAME_VALUE:
            if tuple(source.meta["val"].shape) != tuple(value.shape):
                return None
        elif node.target in _PERMUTES or node.target in _TRANSPOSES:
            rank = value.dim()
            step = _permutation(node, rank)
            permutation = step if permutation is None else [step[p] for p in permutation]
        else:
            return None
        node = source
    if not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    if permutation is not None and permutation != sorted(permutation):
        return None
    return node


def _permutation(node: torch.fx.Node, rank: int) -> list[int]:
    """The dims of ``node``'s input that its result's dims are."""
    if node.target in _PERMUTES:
        return [d % rank for d in node.args[1]]
    order = list(range(rank))
    if node.target in (aten.t.default, aten.t_copy.default):
        order.reverse()
        return order
    a, b = node.args[1] % rank, node.args[2] % rank
    order[a], order[b] = order[b], order[a]
    return order


def _fold_flips(gm: torch.fx.GraphModule, loop: torch.fx.Node) -> int:
    """Make ``loop`` read its flipped stacked inputs unflipped and write its flipped results unflipped, back to
    front (``scan_in_reverse``)."""
    body_ref, init, xs, shared, _, _ = loop_parts(loop)
    carried = len(init)
    reversed_xs = []
    sources = []
    for x in xs:
        if _flips_layers(x):
            sources.append(x.args[0])
            reversed_xs.append(True)
        else:
            sources.append(x)
            reversed_xs.append(False)
    stacked_results = len(loop.meta["val"]) - carried
    reversed_ys = [False] * stacked_results
    getitems = [u for u in loop.users if u.target is operator.getitem and u.args[1] >= carried]
    for getitem in getitems:
        users = list(getitem.users)
        if users and all(_flips_layers(u) for u in users):
            reversed_ys[getitem.args[1] - carried] = True
            for flip in users:
                flip.replace_all_uses_with(getitem)
            for flip in users:
                gm.graph.erase_node(flip)
    folded = sum(reversed_xs) + sum(reversed_ys)
    if not folded:
        return 0
    loop.target = scan_in_reverse
    loop.args = (body_ref, init, sources, shared, tuple(reversed_xs), tuple(reversed_ys))
    return folded


def _flips_layers(node: Any) -> bool:
    """Whether ``node`` is a ``flip`` of a stack's leading (layer) dimension only."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is aten.flip.default):
        return False
    rank = node.args[0].meta["val"].dim()
    return [d % rank for d in node.args[1]] == [0]

