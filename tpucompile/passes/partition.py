"""Split a graph into regions tpucompile can compile and single ops that must run in eager PyTorch.

Supported nodes are grouped into submodules (``fused_0``, ``fused_1``, …) by torch.fx's capability-based
partitioner, which keeps the groups acyclic; unsupported nodes stay in the outer graph as ordinary ATen
calls. The caller compiles each submodule and swaps it in; the outer graph then runs as Python, handing
tensors between eager ops and compiled regions.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

NodePredicate = Callable[[torch.fx.Node], bool]


class _Support(OperatorSupportBase):
    def __init__(self, is_supported: NodePredicate) -> None:
        self._is_supported = is_supported

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:  # stays with the op whose tuple it takes apart
            source = node.args[0]
            return not isinstance(source, torch.fx.Node) or self.is_node_supported(submodules, source)
        return self._is_supported(node)


def partition_supported(gm: torch.fx.GraphModule, is_supported: NodePredicate) -> list[str]:
    """Fuse the supported regions of ``gm`` into submodules in place; returns their names in graph order."""
    partitioner = CapabilityBasedPartitioner(gm, _Support(is_supported), allows_single_node_partition=True)
    partitioned = partitioner.partition_and_fuse()
    if partitioned is not gm:  # partition_and_fuse works in place today; keep the caller's module either way
        gm.graph = partitioned.graph
        for name, module in partitioned.named_children():
            gm.add_submodule(name, module)
    gm.recompile()
    names = [node.target for node in gm.graph.nodes if node.op == "call_module"]
    for name in names:
        _copy_input_metadata(gm, name)
    return names


def _copy_input_metadata(gm: torch.fx.GraphModule, name: str) -> None:
    """Give each submodule placeholder the ``meta["val"]`` of the outer value it receives."""
    call = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == name)
    submodule = getattr(gm, name)
    placeholders = [n for n in submodule.graph.nodes if n.op == "placeholder"]
    for placeholder, argument in zip(placeholders, call.args, strict=True):
        if "val" not in placeholder.meta and isinstance(argument, torch.fx.Node) and "val" in argument.meta:
            placeholder.meta["val"] = argument.meta["val"]


def isolate_node(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str) -> torch.fx.GraphModule:
    """Move ``node`` alone into a new submodule ``name`` of ``gm`` and call it in the node's place.

    The submodule takes the node's tensor arguments as placeholders (other arguments stay literal) and
    returns what the node returned, so the node's ``getitem`` users keep working on the outer graph.
    """
    sub_graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}  # outer argument → its placeholder, in call order

    def placeholder(arg: torch.fx.Node) -> torch.fx.Node:
        if arg not in copies:
            copies[arg] = sub_graph.placeholder(arg.name)
            copies[arg].meta.update(arg.meta)
        return copies[arg]

    args = torch.fx.map_arg(node.args, placeholder)
    kwargs = torch.fx.map_arg(node.kwargs, placeholder)
    call = sub_graph.call_function(node.target, args, kwargs)
    call.meta.update(node.meta)
    value = node.meta.get("val")
    if isinstance(value, (list, tuple)):
        items = []
        for index, item in enumerate(value):
            getitem = sub_graph.call_function(operator.getitem, (call, index))
            getitem.meta["val"] = item
            items.append(getitem)
        sub_graph.output(tuple(items))
    else:
        sub_graph.output(call)
    submodule = torch.fx.GraphModule(gm, sub_graph)
    gm.add_submodule(name, submodule)
    with gm.graph.inserting_before(node):
        replacement = gm.graph.call_module(name, tuple(copies))
    replacement.meta.update(node.meta)
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
    gm.recompile()
    return submodule
