"""Bytes per chip of what a compiled ATen graph takes, by use (parameters, gradients, optimiser state, a
backward's saved activations, other inputs): each input's use as the frontend noted it, divided by how its
sharding annotation splits it over the mesh. Runs where graphs compile; step reports read the result."""

from __future__ import annotations

import math

import torch
import torch.fx

from tpucompile.contracts.input_uses import ACTIVATIONS, INPUTS, RETURNED_GRADIENTS, USES, USES_KEY
from tpucompile.sharding.annotate import input_index
from tpucompile.sharding.plan import decode_sharding, shard_annotation


def graph_uses(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Bytes per chip of the inputs of an ATen graph by use (a backward's saved values are ``activations``),
    and for a backward the bytes per chip of the gradients it returns."""
    noted = gm.meta.get(USES_KEY) or ()
    uses = dict.fromkeys(USES, 0)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    backward = any(p.name.startswith("tangents_") for p in placeholders)
    for placeholder in placeholders:
        if not isinstance(placeholder.meta.get("val"), torch.Tensor) or placeholder.name.startswith("tangents_"):
            continue
        index = input_index(placeholder.name)
        if index is None:
            use = ACTIVATIONS if backward else INPUTS
        else:
            use = (noted[index] if index < len(noted) else None) or INPUTS
        uses[use] += _per_chip(placeholder, next((u for u in placeholder.users if u.target is shard_annotation),
                                                  None))
    if backward:
        results = gm.graph.output_node().args[0]
        results = results if isinstance(results, (list, tuple)) else [results]
        uses[RETURNED_GRADIENTS] = sum(_per_chip(r, r if getattr(r, "target", None) is shard_annotation else None)
                                       for r in results if isinstance(r, torch.fx.Node)
                                       and isinstance(r.meta.get("val"), torch.Tensor))
    return uses


def _per_chip(node: torch.fx.Node, annotation: torch.fx.Node | None) -> int:
    value = node.meta["val"]
    size = _without_guard(value.numel() * value.element_size())
    if annotation is None:
        return size
    axes, dims = decode_sharding(annotation.args[1])
    sizes = dict(axes)
    return size // math.prod(sizes[a] for d in dims for a in d)


def _without_guard(size: int | torch.SymInt) -> int:
    """A size's value as traced (its hint), read without ``int()``: that would add a guard to the graph's
    shape environment and pin its symbols to this value for every later use (a bucketed graph would then
    lower every bucket at the traced size)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 0
    return int(size)
