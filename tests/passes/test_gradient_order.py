"""``order_parameter_gradients``: a backward's parameter gradients are tied to the next product of the gradient
stream, so XLA computes each before it, and the values stay eager's."""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from tpucompile import driver
from tpucompile.contracts.schedule_ops import together
from tpucompile.passes import order_parameter_gradients
from tpucompile.passes.gradient_order import PRODUCTS

_RUNS = itertools.count()


class _Stack(nn.Module):
    """SwiGLU blocks with their own weights per layer, as a decoder's MLPs."""

    def __init__(self, width: int = 16, hidden: int = 48, depth: int = 3) -> None:
        super().__init__()
        self.gates = nn.ModuleList(nn.Linear(width, hidden, bias=False) for _ in range(depth))
        self.ups = nn.ModuleList(nn.Linear(width, hidden, bias=False) for _ in range(depth))
        self.downs = nn.ModuleList(nn.Linear(hidden, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for gate, up, down in zip(self.gates, self.ups, self.downs, strict=True):
            x = x + down(F.silu(gate(x)) * up(x))
        return x


def _compiled_step(model: nn.Module, x: torch.Tensor, **options) -> tuple[list[torch.Tensor], list]:
    events: list = []
    remove = driver.add_observer(events.append)
    torch._dynamo.reset()
    try:
        # a plan key of its own per run (an option that changes nothing here), so that each run traces anew
        compiled = torch.compile(model, backend="tpucompile", options={
            "cache_mode": "off", "roll_layers": False, "embed_constant_limit": 4096 + next(_RUNS), **options})
        compiled(x).square().mean().backward()
    finally:
        remove()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads, [e for e in events if e.name.endswith("(backward)")]


def _ties(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is together]


def test_each_layers_parameter_gradients_are_computed_before_the_next_layers_products():
    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(4, 8, 16)
    eager = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    grads, (event,) = _compiled_step(model, x, recompute_product_operands=True)
    for got, want in zip(grads, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

    gm = event.graph
    ties = _ties(gm)
    assert len(ties) >= 4  # the weight gradients of three layers tie to the products of the layers below
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    tied_results = 0
    for tie in ties:
        stream, *bases = tie.args
        items = {item.args[1]: item for item in tie.users}
        assert all(item.target is operator.getitem for item in items.values())
        # the tied stream value is read by one node only: the product after the tie
        (reader,) = items[0].users
        assert reader.target in PRODUCTS and order[reader] > order[tie]
        for index, base in enumerate(bases, start=1):
            assert base.op == "call_function" and base is not stream
            node = items[index]
            while node is not output:  # views of the tied product, then the result
                (node,) = node.users
            tied_results += 1
    results = [n for n in output.all_input_nodes if n.op == "call_function"]
    assert tied_results >= len(results) - 4  # all but the gradients computed after the last product (layer 0's)


def test_the_ties_lower_to_optimization_barriers():
    torch.manual_seed(0)
    _, (event,) = _compiled_step(_Stack(), torch.randn(4, 8, 16), recompute_product_operands=True)
    assert str(event.program.module).count("stablehlo.optimization_barrier") == len(_ties(event.graph)) >= 4


def test_with_the_switch_off_nothing_is_tied():
    torch.manual_seed(0)
    _, (event,) = _compiled_step(_Stack(), torch.randn(4, 8, 16), recompute_product_operands=False)
    assert not _ties(event.graph)
    assert "optimization_barrier" not in str(event.program.module)


def test_a_graph_without_incoming_gradients_is_left_alone():
    gm = torch.fx.symbolic_trace(lambda x, w: torch.mm(torch.relu(x), w).sigmoid())
    before = str(gm.graph)
    assert order_parameter_gradients(gm) == 0
    assert str(gm.graph) == before
