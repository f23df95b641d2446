"""``embedding_bag`` lowerings (forward, forward-only, backward, per-sample-weights backward) against eager.

Each test compiles one function with several modes to keep the compile count low, and checks with the
``aten_ops`` fixture that the ATen ops it is about reached the backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from tests.support import assert_close_tree, assert_compiles_like_eager
from tpucompile import driver
from tpucompile.config import Options

aten = torch.ops.aten

# Ten indices in five bags, one of them empty; index 4 repeats (it is the padding index in some tests).
INDICES = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 4, 4])
OFFSETS = torch.tensor([0, 2, 2, 5, 8])
CLOSED = torch.tensor([0, 2, 2, 5, 8, 10])  # include_last_offset: the last offset closes the last bag


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_modes_with_grad(aten_ops, mode):
    def fn(w, i, o, c):
        return (
            F.embedding_bag(i, w, o, mode=mode),
            F.embedding_bag(i, w, o, mode=mode, padding_idx=4),
            F.embedding_bag(i, w, c, mode=mode, include_last_offset=True),
            F.embedding_bag(i[:8].reshape(2, 4), w, mode=mode),  # 2-d input: fixed-size bags
        )

    assert_compiles_like_eager(fn, torch.randn(10, 3), INDICES, OFFSETS, CLOSED, grad=True)
    assert {aten._embedding_bag.default, aten._embedding_bag_backward.default} <= aten_ops


def test_per_sample_weights_with_grad(aten_ops):
    def fn(w, i, o, p):
        return (
            F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p),
            F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p, padding_idx=2),
        )

    assert_compiles_like_eager(fn, torch.randn(10, 3), INDICES, OFFSETS, torch.rand(10), grad=True)
    assert aten._embedding_bag_per_sample_weights_backward.default in aten_ops


def test_forward_only_int32_bf16(aten_ops):
    def fn(w, i, o, c):
        return (
            F.embedding_bag(i, w, o, mode="sum"),
            F.embedding_bag(i, w, c, mode="mean", include_last_offset=True, padding_idx=4),
            F.embedding_bag(i, w, o, mode="max", padding_idx=4),
            F.embedding_bag(i, w.bfloat16(), o, mode="mean"),
        )

    with torch.no_grad():
        assert_compiles_like_eager(fn, torch.randn(10, 3), INDICES.int(), OFFSETS.int(), CLOSED.int())
    assert aten._embedding_bag_forward_only.default in aten_ops


def test_scale_grad_by_freq():
    """Gradients scaled by each index's frequency in the batch, as ``F.embedding(..., scale_grad_by_freq)``
    documents. (PyTorch's CPU ``_embedding_bag_backward`` applies the counts to the wrong rows, so the
    reference is built from ``F.embedding`` and a segment sum, not from ``F.embedding_bag``.)"""
    bags = torch.tensor([0, 0, 2, 2, 2, 3, 3, 3, 4, 4])
    sizes = torch.tensor([2, 0, 3, 3, 2]).clamp(min=1).unsqueeze(1)

    def reference(w, i):
        rows = F.embedding(i, w, scale_grad_by_freq=True)
        total = torch.zeros(5, 3).index_add(0, bags, rows)
        return total, total / sizes

    def compiled(w, i, o):
        return (
            F.embedding_bag(i, w, o, mode="sum", scale_grad_by_freq=True),
            F.embedding_bag(i, w, o, mode="mean", scale_grad_by_freq=True),
        )

    w = torch.randn(10, 3)
    expected_w = w.clone().requires_grad_()
    expected = reference(expected_w, INDICES)
    actual_w = w.clone().requires_grad_()
    actual = torch.compile(compiled, backend="tpucompile", fullgraph=True)(actual_w, INDICES, OFFSETS)
    assert_close_tree(actual, expected)
    grads = [torch.linspace(0.5, 1.5, 15).reshape(5, 3), torch.linspace(-1.0, 2.0, 15).reshape(5, 3)]
    torch.autograd.backward(expected, grads)
    torch.autograd.backward(actual, grads)
    assert_close_tree(actual_w.grad, expected_w.grad)


def test_dense_backward_rule():
    """``_embedding_bag_dense_backward`` does not reach a backend through ``F.embedding_bag`` (autograd
    calls ``_embedding_bag_backward``); its rule is checked on a graph traced without decompositions."""
    w = torch.randn(10, 3)
    grad = torch.randn(5, 3)

    def fn(w, i, o, g):
        _, offset2bag, bag_size, max_indices = aten._embedding_bag(w, i, o, False, 1, False, None, False, 4)
        mean = aten._embedding_bag_dense_backward(g, i, offset2bag, bag_size, max_indices, 10, False, 1, None, 4)
        _, offset2bag, bag_size, max_indices = aten._embedding_bag(w, i, o, False, 2, False, None, False, -1)
        largest = aten._embedding_bag_dense_backward(g, i, offset2bag, bag_size, max_indices, 10, False, 2, None)
        return mean, largest

    inputs = [w, INDICES, OFFSETS, grad]
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    assert aten._embedding_bag_dense_backward.default in {n.target for n in gm.graph.nodes}
    assert_close_tree(driver.compile_graph(gm, inputs, Options(), "test_dense_backward")(inputs), list(fn(*inputs)))
