"""Loops as ``stablehlo.while``: a scan written by the user and its backward (which reads the forward's stacks and
writes each iteration's weight gradient back to front by the loop's index, never through a flip of a whole
stack), against eager PyTorch. Each iteration's weight differs, so a gradient written to the wrong slice
fails."""

from __future__ import annotations

import torch
from torch._higher_order_ops.scan import scan

from tpucompile import driver
from tpucompile.contracts.loop_ops import is_loop


def _cell(carry: torch.Tensor, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, list]:
    weight, bias = x
    return torch.tanh(carry @ weight + bias) + carry, []


def _model(h0: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    last, _ = scan(_cell, h0 * 1, (weights * 1, biases * 1))  # inputs of their own, as rolled layers have
    return (last * last).sum()


def test_a_scan_and_its_backward_run_as_loops(cache_dir):
    torch.manual_seed(0)
    h0 = torch.randn(3, 8, requires_grad=True)
    weights = (torch.randn(5, 8, 8) * 0.3).requires_grad_()
    biases = torch.randn(5, 8).requires_grad_()
    graphs: dict[str, torch.fx.GraphModule] = {}
    remove = driver.add_observer(lambda event: graphs.setdefault(event.name.rsplit("(", 1)[-1], event.graph))
    try:
        loss = torch.compile(_model, backend="tpucompile")(h0, weights, biases)
        grads = torch.autograd.grad(loss, (h0, weights, biases))
    finally:
        remove()
    expected = _model(h0, weights, biases)
    expected_grads = torch.autograd.grad(expected, (h0, weights, biases))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for role in ("forward)", "backward)"):
        nodes = list(graphs[role].graph.nodes)
        assert any(is_loop(n) for n in nodes), f"no loop in the {role[:-1]}"
        assert not any(n.target is torch.ops.aten.flip.default for n in nodes), f"a stack is flipped in the {role[:-1]}"
