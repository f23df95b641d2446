"""The values that pass between a model's repeated blocks, marked to be saved for the backward.

When a step does not fit its chip at the full activation budget, AOTAutograd's knapsack picks values to
recompute by size and cost alone, and on a transformer it tends to drop the residual stream: the backward then
recomputes layer after layer from the embedding, and XLA keeps every layer's copy of the stream alive at once
(a 0.86B decoder at 8 x 2048 tokens needed 22.7 GiB where the estimate said 14.8). Saving the values that cross
from one block (an element of an ``nn.ModuleList`` or ``nn.Sequential``: a transformer layer, a ResNet stage's
unit) to the next confines recomputation to one block at a time, as per-layer activation checkpointing does,
while the knapsack still chooses what to keep inside each block.

A node's block is read from the module path Dynamo records for it (``meta["nn_module_stack"]``): the path up to
its first indexed component. Values are marked with the partitioner's own ``CheckpointPolicy.MUST_SAVE``, which
bans their recomputation (below budget 1) and keeps them in the knapsack's saved set.
"""

from __future__ import annotations

import re

import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

_ROOT = re.compile(r"^L\[[^\]]*\](?:\[\d+\])*")
"""Dynamo's source of the compiled module itself (``L['self']``, ``L['args'][0]``), before its submodules'
names."""
_INDEX = re.compile(r"\.\d+(?=\.|\[|$)|\[\d+\]")
"""An indexed component of a module path: ``.3`` (as Dynamo writes ``layers.3``) or ``[3]``."""


def block_of(node: torch.fx.Node) -> str | None:
    """The repeated block ``node`` was traced in (its module path up to the first index), or None outside any."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    innermost_path = list(stack.values())[-1][0]
    path = _ROOT.sub("", innermost_path)
    index = _INDEX.search(path)
    return path[:index.end()] if index else None


def mark_block_boundaries(joint: torch.fx.GraphModule, forward_outputs: int) -> int:
    """Mark every forward value the forward reads in another block than its own (or made outside the blocks and
    read in one, or the reverse) as one the forward must save; the number of values marked, 0 when the graph
    has fewer than two blocks (nothing is marked then). ``forward_outputs``: how many of the joint graph's
    outputs are the forward's (AOTAutograd's ``num_fwd_outputs``)."""
    forward = _forward_nodes(joint.graph, forward_outputs)
    blocks = {node: block_of(node) for node in forward}
    if len({block for block in blocks.values() if block is not None}) < 2:
        return 0
    marked = 0
    for node, own in blocks.items():
        if node.op != "call_function" or node.meta.get("recompute") is not None:
            continue  # a policy already set (torch.utils.checkpoint's) is the user's
        if any(user in blocks and blocks[user] != own and (own or blocks[user]) for user in node.users):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            marked += 1
    return marked


def _forward_nodes(graph: torch.fx.Graph, forward_outputs: int) -> set[torch.fx.Node]:
    """Nodes of the joint graph the forward's outputs (the first ``forward_outputs`` of the graph's) depend on:
    the forward program; the rest is the backward's, whether or not it reads the gradients."""
    outputs = graph.output_node().args[0][:forward_outputs]
    pending = [value for value in outputs if isinstance(value, torch.fx.Node)]
    forward: set[torch.fx.Node] = set()
    while pending:
        node = pending.pop()
        if node not in forward:
            forward.add(node)
            pending.extend(node.all_input_nodes)
    return forward
