"""Graphs of meta tensors trace into the ATen graphs real tensors give (``frontend.meta_tracing``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._C import DispatchKey
from torch._dynamo.backends.common import aot_autograd

from tpucompile.frontend.meta_tracing import traced_like_real_tensors


def _traced_graphs(device: str) -> tuple[list[str], list[bool]]:
    """The ATen ops of the forward and backward graphs of a linear layer + cross-entropy on ``device``, and
    whether each parameter got a gradient."""
    graphs: list[str] = []

    def keep(gm, example_inputs):
        graphs.append(" ".join(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward

    torch._dynamo.reset()
    with torch.device(device):
        layer = torch.nn.Linear(16, 10)
    x, y = torch.randn(4, 16, device=device), torch.zeros(4, dtype=torch.long, device=device)
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)

    def loss(x, y):
        return F.cross_entropy(layer(x), y)

    example = [x, y, *layer.parameters()]
    with traced_like_real_tensors(example):
        out = torch.compile(loss, backend=backend)(x, y)
    out.backward()
    return graphs, [p.grad is not None for p in layer.parameters()]


def test_a_loss_inside_the_graph_has_gradients_on_meta_as_on_cpu():
    meta_graphs, meta_grads = _traced_graphs("meta")
    cpu_graphs, cpu_grads = _traced_graphs("cpu")
    assert meta_grads == cpu_grads == [True, True]
    assert meta_graphs == cpu_graphs  # the same ATen graphs, so the same cache keys


def test_the_meta_kernels_come_back_afterwards():
    op = torch.ops.aten.nll_loss.default
    before = dict(op.py_kernels)
    with traced_like_real_tensors([torch.empty(1, device="meta")]):
        assert DispatchKey.Meta not in op.py_kernels
    assert op.py_kernels == before
    with traced_like_real_tensors([torch.empty(1)]):  # nothing to do for real tensors
        assert op.py_kernels == before
