"""``_batch_norm_with_update`` (``rules/batch_norm.py``) and the batch-chunked ``F.linear_cross_entropy`` ops
(``rules/losses.py``) against eager, with gradients."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions

from tests.support import assert_compiles_like_eager

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(int(os.environ.get("TPUCOMPILE_TEST_SEED", "0")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_batch_norm_with_update(aten_ops, dtype):
    def fn(x, weight, bias):
        running_mean = torch.zeros(3, dtype=dtype)
        running_var = torch.ones(3, dtype=dtype)
        out, mean, invstd, _ = aten._batch_norm_with_update(x, weight, bias, running_mean, running_var, 0.1, 1e-5)
        return out, mean, invstd, running_mean, running_var

    x = torch.randn(4, 3, 5).to(dtype)
    weight, bias = (torch.rand(3) + 0.5).to(dtype), torch.randn(3).to(dtype)
    assert_compiles_like_eager(fn, x, weight, bias, grad=dtype is torch.float32)
    assert aten._batch_norm_with_update_functional.default in aten_ops
    if dtype is torch.float32:
        assert aten.batch_norm_backward.default in aten_ops


_OPTIONS = LinearCrossEntropyOptions(allow_retain_graph=True, batch_chunk_size=3, chunking_method="auto",
                                     acc_policy="auto")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_chunked(aten_ops, reduction):
    x, linear_weight, linear_bias = torch.randn(8, 3), torch.randn(5, 3), torch.randn(5)
    target = torch.tensor([0, 1, 4, 3, -100, 1, 2, 0])  # one ignored row
    class_weight = torch.rand(5) + 0.5
    assert_compiles_like_eager(
        lambda x, w, b: F.linear_cross_entropy(x, w, target, linear_bias=b, weight=class_weight,
                                               reduction=reduction, options=_OPTIONS),
        x, linear_weight, linear_bias, grad=True,
    )
    op = "_linear_cross_entropy_batch_chunked" + ("_no_reduction" if reduction == "none" else "")
    assert getattr(torch.ops.torch_nn, op).default in aten_ops


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class-weights"])
@pytest.mark.parametrize("shape", [(6, 5), (5,), (2, 5, 3, 4)], ids=["rows", "no-batch", "image"])
def test_nll_loss_backward_as_a_one_hot(aten_ops, reduction, weighted, shape):
    """Cross-entropy's gradient through the one-hot decomposition of ``nll_loss_backward`` (and ``2d``): equal to
    eager for every reduction, class weights, ignored targets, no batch dim and per-pixel targets, and no
    scatter left in the graph that XLA would have to run over the logits' whole size."""
    classes = shape[0] if len(shape) == 1 else shape[1]
    target_shape = () if len(shape) == 1 else (shape[0], *shape[2:])
    target = torch.randint(0, classes, target_shape)
    if target.dim():
        target.view(-1)[1] = -100  # an ignored element
    weight = torch.rand(classes) + 0.5 if weighted else None
    if len(shape) == 1 and reduction == "none":
        reduction = "sum"  # a 1-d input has one loss; "none" gives it as a 0-d tensor, covered by "sum"
    assert_compiles_like_eager(
        lambda x: F.cross_entropy(x, target, weight=weight, reduction=reduction), torch.randn(shape), grad=True)
    backward = aten.nll_loss2d_backward.default if len(shape) == 4 else aten.nll_loss_backward.default
    assert backward not in aten_ops, "the backward reached the lowering undecomposed"
    assert not {aten.scatter.value, aten.scatter.src, aten.scatter_add.default} & aten_ops


def test_nll_loss_backward_bfloat16_language_model_head():
    """A bf16 head of a language model: logits of (tokens, vocabulary), the mean loss and its gradient as eager
    computes them (bf16 rounding of the one-hot gradient, same tolerance as any bf16 elementwise op)."""
    logits = torch.randn(64, 300).to(torch.bfloat16)
    target = torch.randint(0, 300, (64,))
    assert_compiles_like_eager(lambda x: F.cross_entropy(x, target), logits, grad=True, atol=2e-2, rtol=2e-2)
