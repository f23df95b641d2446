"""Convolution lowerings (``aten.convolution`` and ``aten.convolution_backward``) against eager PyTorch.

End to end through ``torch.compile`` with gradients (the ``aten_ops`` fixture proves both ops reached the
backend), and the backward rule alone on graphs traced with ``make_fx`` for the ``output_mask`` combinations
that autograd only produces when some inputs need no gradient.
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

CONVOLUTION_OPS = {aten.convolution.default, aten.convolution_backward.default}


# (function, input shapes): input, weight[, bias]
CASES = {
    "1d_stride": (lambda x, w: F.conv1d(x, w, stride=3), [(2, 4, 11), (6, 4, 3)]),
    "2d_groups_bias_pad": (
        lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=2),
        [(2, 4, 8, 7), (6, 2, 3, 3), (6,)],
    ),
    "2d_dilation_asymmetric": (
        lambda x, w: F.conv2d(x, w, stride=(2, 3), padding=(0, 2), dilation=(2, 1)),
        [(2, 3, 9, 10), (5, 3, 3, 2)],
    ),
    "2d_padding_beyond_kernel": (lambda x, w: F.conv2d(x, w, padding=4), [(1, 2, 3, 3), (3, 2, 3, 3)]),
    "2d_same_even_kernel": (lambda x, w: F.conv2d(x, w, padding="same"), [(1, 2, 6, 6), (3, 2, 4, 4)]),
    "3d_groups_bias": (
        lambda x, w, b: F.conv3d(x, w, b, padding=1, groups=3),
        [(1, 6, 4, 3, 5), (3, 2, 3, 3, 2), (3,)],
    ),
    "transposed_1d_output_padding": (
        lambda x, w: F.conv_transpose1d(x, w, stride=3, padding=2, output_padding=2),
        [(2, 4, 7), (4, 6, 3)],
    ),
    "transposed_2d_groups_dilation_bias": (
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1, groups=2, dilation=2),
        [(2, 4, 5, 6), (4, 3, 3, 3), (6,)],
    ),
    "transposed_2d_padding_beyond_kernel": (
        lambda x, w: F.conv_transpose2d(x, w, padding=3),
        [(1, 2, 8, 7), (2, 3, 3, 3)],
    ),
    "transposed_3d_stride": (
        lambda x, w: F.conv_transpose3d(x, w, stride=(2, 1, 2)),
        [(1, 2, 3, 2, 3), (2, 3, 2, 2, 2)],
    ),
}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("case", CASES)
def test_convolution_float32(aten_ops, case):
    fn, shapes = CASES[case]
    assert_compiles_like_eager(fn, *[torch.randn(s) for s in shapes], grad=True)
    assert aten_ops >= CONVOLUTION_OPS


def _convolutions(x1, w1, x2, w2, b2, x3, w3):
    return (
        F.conv1d(x1, w1, padding=1, stride=2),
        F.conv2d(x2, w2, b2, padding=1, groups=2),
        F.conv_transpose2d(x2, w3, stride=2, output_padding=1),
        F.conv3d(x3, torch.ones(2, 2, 2, 2, 2, dtype=x3.dtype, device=x3.device)),
    )


@pytest.mark.parametrize("seed", range(4))
def test_convolution_bfloat16(aten_ops, seed):
    """bf16 convolutions of each kind and their gradients accumulate in f32: each result is within a bf16
    rounding or two (``x2``'s gradient adds two of them) of the f32 computation on the same bf16 values.

    Eager is not the reference here: where oneDNN has no bf16 dot instructions (CPUs without AVX512-BF16),
    eager rounds partial sums to bf16 and its input gradients stray up to ~2% of the largest gradient from
    the f32 result (measured with ``ONEDNN_MAX_CPU_ISA=AVX2``), so it is held to that looser bound only."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, 4, 9), (3, 4, 3), (2, 4, 6, 5), (6, 2, 3, 3), (6,), (1, 2, 3, 4, 3), (4, 3, 2, 2)]
    inputs = [torch.randn(s, generator=generator).bfloat16().requires_grad_() for s in shapes]
    torch._dynamo.reset()
    outputs = torch.compile(_convolutions, backend="tpucompile", fullgraph=True)(*inputs)
    cotangents = [torch.randn(o.shape, generator=generator).bfloat16() for o in outputs]
    grads = torch.autograd.grad(outputs, inputs, cotangents)
    exact_inputs = [x.detach().float().requires_grad_() for x in inputs]
    exact_outputs = _convolutions(*exact_inputs)
    exact_grads = torch.autograd.grad(exact_outputs, exact_inputs, [c.float() for c in cotangents])
    eager_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    eager_outputs = _convolutions(*eager_inputs)
    eager_grads = torch.autograd.grad(eager_outputs, eager_inputs, cotangents)
    results = zip((*outputs, *grads), (*exact_outputs, *exact_grads), (*eager_outputs, *eager_grads), strict=True)
    for index, (actual, exact, eager) in enumerate(results):
        assert actual.dtype == torch.bfloat16
        scale = exact.abs().max().item()
        torch.testing.assert_close(actual.float(), exact, rtol=2**-7, atol=2**-8 * scale, msg=f"result {index}")
        torch.testing.assert_close(actual.float(), eager.float(), rtol=0, atol=3e-2 * scale, msg=f"result {index}")
    assert aten_ops >= CONVOLUTION_OPS


def test_unbatched_and_module(aten_ops):
    conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=True)
    assert_compiles_like_eager(lambda x: conv(torch.relu(x)), torch.randn(3, 6, 5), grad=True)
    assert aten_ops >= CONVOLUTION_OPS


def _backward_fn(mask, stride=(2, 1), padding=(1, 0), dilation=(1, 2), transposed=False, output_padding=(0, 0),
                 groups=2):
    def fn(gy, x, w):
        return aten.convolution_backward(
            gy, x, w, [w.shape[1] * groups if transposed else w.shape[0]], list(stride), list(padding), list(dilation),
            transposed, list(output_padding), groups, mask,
        )

    return fn


@pytest.mark.parametrize("mask", [[True, False, False], [False, True, True], [True, True, False]])
@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_backward_output_mask(mask, transposed):
    x = torch.randn(2, 4, 7, 6)
    if transposed:
        w = torch.randn(4, 3, 3, 2)
        y = aten.convolution(x, w, None, [2, 1], [1, 0], [1, 2], True, [1, 0], 2)
        fn = _backward_fn(mask, transposed=True, output_padding=(1, 0))
    else:
        w = torch.randn(6, 2, 3, 2)
        y = aten.convolution(x, w, None, [2, 1], [1, 0], [1, 2], False, [0, 0], 2)
        fn = _backward_fn(mask)
    inputs = [torch.randn(y.shape), x, w]
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    assert aten.convolution_backward.default in {n.target for n in gm.graph.nodes}
    compiled = driver.compile_graph(gm, inputs, Options(), "test_convolution")
    actual = compiled(inputs)
    assert_close_tree(list(actual), list(fn(*inputs)))
