"""A loop's body is part of its program's key: two programs that differ only inside the body never share an
entry, and a rolled model's programs are cached and served to a fresh compile."""

from __future__ import annotations

import operator

import torch
import torch.fx

from tpucompile import driver
from tpucompile.artifacts.fingerprint import encode_graph
from tpucompile.contracts.loop_ops import is_loop
from tpucompile.lowering import ShapeBindings


def _looped(scale: float) -> torch.fx.GraphModule:
    body_graph = torch.fx.Graph()
    carry = body_graph.placeholder("carry")
    weight = body_graph.placeholder("weight")
    product = body_graph.call_function(torch.ops.aten.mul.Tensor, (carry, weight))
    body_graph.output([body_graph.call_function(torch.ops.aten.add.Tensor, (product, scale))])
    root = torch.nn.Module()
    root.body = torch.fx.GraphModule(torch.nn.Module(), body_graph)
    graph = torch.fx.Graph()
    x, weights = graph.placeholder("x"), graph.placeholder("weights")
    loop = graph.call_function(torch.ops.higher_order.scan, (graph.get_attr("body"), [x], [weights], []))
    graph.output([graph.call_function(operator.getitem, (loop, 0))])
    return torch.fx.GraphModule(root, graph)


def test_a_loop_body_is_in_the_key():
    same = encode_graph(_looped(1.0), ShapeBindings(), values=False)[0]
    assert same == encode_graph(_looped(1.0), ShapeBindings(), values=False)[0]
    assert same != encode_graph(_looped(2.0), ShapeBindings(), values=False)[0]


def test_a_rolled_model_is_served_from_the_cache(cache_dir):
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4)])

    x = torch.randn(3, 16)
    hits: list[bool] = []
    loops: list[bool] = []
    remove = driver.add_observer(lambda event: (hits.append(event.cache_hit),
                                                loops.append(event.graph is not None and any(
                                                    is_loop(n) for n in event.graph.graph.nodes))))
    try:
        for _ in range(2):
            torch._dynamo.reset()
            net = model()
            torch.compile(net, backend="tpucompile", options={"roll_layers": True})(x).sum().backward()
    finally:
        remove()
    assert any(loops), "the layers were not rolled"
    assert hits == [False, False, True, True], hits  # forward and backward compiled, then both served
