"""Tensor constants (``get_attr`` nodes): small ones are embedded in the program, large ones become extra
arguments so that the program text, and its cache key, do not carry megabytes of weights."""

from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily


def lift_large_constants(gm: torch.fx.GraphModule, limit: int) -> list[torch.Tensor]:
    """Turn each tensor constant with more than ``limit`` elements into a trailing placeholder.

    Returns the tensors, in the order of the new placeholders; the caller passes them after the graph's
    own arguments on every call.
    """
    graph = gm.graph
    lifted: list[torch.Tensor] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    insert_after = placeholders[-1] if placeholders else None
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, str(node.target), None)
        if not isinstance(value, torch.Tensor) or value.numel() <= limit:
            continue
        if insert_after is None:
            context = graph.inserting_before(next(iter(graph.nodes)))
        else:
            context = graph.inserting_after(insert_after)
        with context:
            placeholder = graph.placeholder(f"lifted_{str(node.target).replace('.', '_')}")
        placeholder.meta.update(node.meta)
        placeholder.meta["val"] = value
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
        insert_after = placeholder
        with unset_fake_temporarily():  # AOTAutograd's fake mode is on while its compilers run
            lifted.append(value.detach())
    if lifted:
        gm.recompile()
    return lifted
