"""A rolled step saves what the unrolled one saves, and its forward loop writes no stack that repeats one it
reads: without the tidying of the joint graph, PyTorch's loop partition writes every layer's weights a second
time (transposed twice) as a result of the loop, and flips whole stacks for the backward."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from tpucompile import driver
from tpucompile.contracts.loop_ops import is_loop
from tpucompile.frontend import activation_budget

_RUNS = itertools.count()


def _saved(roll: bool) -> tuple[int, list[torch.fx.GraphModule]]:
    """The bytes a 4-layer MLP stack's forward hands its backward (activations and weights), and the graphs.
    Each run has a plan key of its own (an option that changes nothing here), so none replays another's."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)) for _ in range(4)])
    x = torch.randn(8, 64, requires_grad=True)
    events: list = []
    remove = driver.add_observer(events.append)
    torch._dynamo.reset()
    try:
        out = torch.compile(net, backend="tpucompile", options={
            "roll_layers": roll, "cache_mode": "off", "embed_constant_limit": 4096 + next(_RUNS)})(x)
        out.square().sum().backward()
        grad = x.grad.clone()
        x.grad = None
        net(x).square().sum().backward()
        torch.testing.assert_close(grad, x.grad)
    finally:
        remove()
    (saved,) = [e.saved_for_backward() for e in events if e.saved_for_backward() is not None]
    return saved["activations"] + saved["arguments"], [e.graph for e in events]


def _loop_results(graphs: list[torch.fx.GraphModule]) -> int:
    """How many stacks the forward's loop writes."""
    forward = graphs[0]
    (loop,) = [n for n in forward.graph.nodes if is_loop(n)]
    return len(loop.meta["val"]) - len(loop.args[1])


def _flips(graphs: list[torch.fx.GraphModule]) -> int:
    return sum(n.target is torch.ops.aten.flip.default for g in graphs for n in g.graph.nodes)


def test_a_rolled_step_saves_what_the_unrolled_one_does_and_copies_no_stack(monkeypatch):
    rolled, graphs = _saved(True)
    unrolled, _ = _saved(False)
    assert rolled <= unrolled * 1.01, (rolled, unrolled)
    assert _flips(graphs) == 0
    monkeypatch.setattr(activation_budget, "tidy_rolled_loops", lambda gm: 0)
    _, untidy_graphs = _saved(True)
    # PyTorch's partition alone: the two weights of each layer come back out of the loop, and stacks are flipped
    assert _loop_results(untidy_graphs) >= _loop_results(graphs) + 2 and _flips(untidy_graphs) > 0
