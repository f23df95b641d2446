"""Hold a backward's parameter gradients to the order the graph computes them in.

A parameter's gradient is a product (``dW = x^T @ dy``) that nothing in the backward reads: only the program's
result does. XLA's TPU scheduler may then put every layer's weight-gradient products at the program's end,
which keeps each layer's operands of them (a ``[tokens, hidden]`` gradient, a recomputed activation) alive
from its layer to the end: with SwiGLU's operands recomputed (``recompute_product_operands``), a 0.86B Llama's
backward held sixteen 88 MiB gradients that way, 2.1 GiB of temporaries. Before each product of the gradient
stream, the gradients finished since the previous one pass through ``together`` with the operand of that
product computed from the incoming gradient, so they are computed before it, as autograd's order has them.
A gradient returned through views (PyTorch returns ``dW`` as the transpose of the product it computes) is tied
as the product and viewed again after the tie. The stream's operand is tied as the product reads it: XLA must
then write it out where it would have fused it into the product, which is this ordering's cost in cycles
(``docs/benchmarks.md``); tied as computed and viewed again, it cost more (measured).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from tpucompile.contracts.schedule_ops import together
from tpucompile.passes.noop_views import is_view

aten = torch.ops.aten

PRODUCTS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
                      aten.convolution.default, aten.convolution_backward.default})


def order_parameter_gradients(gm: torch.fx.GraphModule) -> int:
    """Tie the results of ``gm`` (a backward graph: placeholders named ``tangents_*`` are its incoming
    gradients) to the gradient products that follow them; returns how many ties were made. A graph without
    incoming gradients, or whose results are all computed after its last product, is left as it is."""
    graph = gm.graph
    late = _reads_gradients(graph)
    output = next(n for n in graph.nodes if n.op == "output")
    results = {n for n in output.all_input_nodes if n in late and n.op == "call_function"}
    pending: list[torch.fx.Node] = []
    ties = 0
    for node in list(graph.nodes):
        if node in results:
            pending.append(node)
            continue
        if node.target not in PRODUCTS or not pending:
            continue
        stream = _stream_operand(node, late, results)
        if stream is None:
            continue
        chains = [_through_views(result) for result in pending]
        tied = [stream, *(base for base, _ in chains)]
        with graph.inserting_before(node):
            barrier = graph.call_function(together, tuple(tied))
            items = [graph.call_function(operator.getitem, (barrier, index)) for index in range(len(tied))]
            viewed = [_view_again(graph, item, views) for item, (_, views) in zip(items[1:], chains, strict=True)]
        barrier.meta["val"] = tuple(value.meta["val"] for value in tied)
        for item, value in zip(items, tied, strict=True):
            item.meta["val"] = value.meta["val"]
        node.replace_input_with(stream, items[0])
        for result, replacement in zip(pending, viewed, strict=True):
            output.replace_input_with(result, replacement)
        pending = []
        ties += 1
    graph.lint()
    gm.recompile()
    return ties


def _stream_operand(product: torch.fx.Node, late: set[torch.fx.Node], results: set[torch.fx.Node]
                    ) -> torch.fx.Node | None:
    """The tensor operand of ``product`` computed from the incoming gradients (not itself a result), if any."""
    return next((source for source in product.all_input_nodes if source in late and source not in results
                 and isinstance(source.meta.get("val"), torch.Tensor)), None)


def _through_views(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The value ``node`` views (itself when it is no view) and the views in between, the outermost first."""
    views = []
    while node.op == "call_function" and is_view(node) and isinstance(node.args[0], torch.fx.Node):
        views.append(node)
        node = node.args[0]
    return node, views


def _view_again(graph: torch.fx.Graph, value: torch.fx.Node, views: list[torch.fx.Node]) -> torch.fx.Node:
    """``views`` (the outermost first) applied again, to ``value``."""
    for view in reversed(views):
        value = graph.node_copy(view, lambda source, view=view, value=value:
                                value if source is view.args[0] else source)
    return value


def _reads_gradients(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes computed from an incoming gradient."""
    late: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                late.add(node)
        elif node.op == "call_function" and any(source in late for source in node.all_input_nodes):
            late.add(node)
    return late

