"""Depthwise convolutions in CPU programs, written as sums over their taps (``runtime/depthwise.py``): the
same values and gradients as eager PyTorch and as XLA's own convolution, across ranks, strides, dilations,
paddings and dtypes; and the rewrite happens (XLA's program holds no grouped convolution for the forward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.cached_runs import fresh_start
from tpucompile.runtime import depthwise, get_target
from tpucompile.runtime.compiler import compile_module, optimized_hlo
from tpucompile.runtime.transfer import to_buffer, to_tensor
from tpucompile.runtime.xla_options import compile_options

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@pytest.mark.parametrize(("rank", "kernel", "stride", "dilation", "padding", "multiplier"), [
    (2, 3, 1, 1, 1, 1), (2, 7, 1, 1, 3, 1), (2, 3, 2, 1, 1, 1), (2, 3, 1, 2, 2, 1), (2, 5, 2, 1, 0, 1),
    (2, 3, 1, 1, "same", 1), (2, 7, 2, 1, 3, 2), (2, 3, 1, 1, 1, 3), (1, 5, 1, 1, 2, 1), (1, 3, 2, 1, 0, 1),
    (3, 3, 1, 1, 1, 1),
], ids=["3x3", "7x7", "stride2", "dilation2", "5x5-stride2-nopad", "same", "7x7-stride2-two-per-group",
        "three-per-group", "1d", "1d-stride2", "3d"])
def test_depthwise_convolutions_match_eager_forward_and_backward(rank, kernel, stride, dilation, padding,
                                                                 multiplier, seeded):
    channels, size = 6, 9
    x = torch.randn(2, channels, *([size] * rank), requires_grad=True)
    w = torch.randn(channels * multiplier, 1, *([kernel] * rank), requires_grad=True)
    b = torch.randn(channels * multiplier, requires_grad=True)

    def conv(x, w, b):
        return _CONV[rank](x, w, b, stride=stride, padding=padding, dilation=dilation, groups=channels)

    with fresh_start() as events:
        got = torch.compile(conv, backend="tpucompile")(x, w, b)
        weights = torch.randn_like(got)
        grads = torch.autograd.grad((got * weights).sum(), (x, w, b))
    expected = conv(x, w, b)
    expected_grads = torch.autograd.grad((expected * weights).sum(), (x, w, b))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for grad, reference in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-4)
    forward, backward = events
    assert "feature_group_count=6" not in optimized_hlo(forward.executable), "the forward was rewritten"
    # the kernel gradient and (with one output per group) the input gradient are rewritten; with several
    # outputs per group the input gradient has several features per group and stays XLA's convolution
    left = _convolutions(depthwise.rewrite(backward.program.bytecode()))
    assert left == (0 if multiplier == 1 else 1), left


def test_the_rewrite_against_xla_own_convolution(seeded):
    """The same program compiled as it is (XLA's grouped convolution) and rewritten: equal results."""
    x, w = torch.randn(2, 8, 12, 12), torch.randn(8, 1, 3, 3)
    with fresh_start() as events:
        torch.compile(lambda x, w: F.conv2d(x, w, padding=1, groups=8).relu(), backend="tpucompile")(x, w)
    module = events[0].program.bytecode()
    rewritten = depthwise.rewrite(module)
    assert rewritten is not module and _convolutions(rewritten) == 0 and _convolutions(module) == 1
    target = get_target(None)
    own = target.client.compile_and_load(module, target.device_list(), compile_options(target))
    assert "feature_group_count=8" in optimized_hlo(own)
    outputs = []
    for loaded in (own, compile_module(module, target, host_ops=())):
        (result,) = loaded.execute([to_buffer(x, target.device), to_buffer(w, target.device)])
        outputs.append(to_tensor(result))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def _convolutions(module: bytes) -> int:
    from jax.extend.mlir import ir

    from tpucompile.runtime.mlir_walk import context, walk_operations

    with context():
        parsed = ir.Module.parse(module)
        return sum(op.name == "stablehlo.convolution" for op in walk_operations(parsed.operation))


def test_grouped_convolutions_that_are_not_depthwise_stay_convolutions():
    x, w = torch.randn(2, 8, 6, 6), torch.randn(8, 2, 3, 3)  # 4 groups of 2 features
    with fresh_start() as events:
        got = torch.compile(lambda x, w: F.conv2d(x, w, groups=4), backend="tpucompile")(x, w)
    torch.testing.assert_close(got, F.conv2d(x, w, groups=4), rtol=1e-4, atol=1e-4)
    module = events[0].program.bytecode()
    assert depthwise.rewrite(module) is module


def test_the_option_off_compiles_xla_own_convolution_under_another_key(seeded):
    """``cpu_depthwise_taps=False``: the executable holds XLA's grouped convolution, gives the rewritten
    program's values (forward and gradients), and is stored under a key of its own."""
    x = torch.randn(2, 8, 12, 12, requires_grad=True)
    w = torch.randn(8, 1, 3, 3, requires_grad=True)

    def conv(x, w):
        return F.conv2d(x, w, padding=1, groups=8).relu()

    runs = {}
    for taps in (True, False):
        with fresh_start() as events:
            got = torch.compile(conv, backend="tpucompile", options={"cpu_depthwise_taps": taps})(x, w)
            grads = torch.autograd.grad(got.square().sum(), (x, w))
        runs[taps] = (got, grads, events)
    (on, on_grads, on_events), (off, off_grads, off_events) = runs[True], runs[False]
    torch.testing.assert_close(off, on, rtol=1e-5, atol=1e-5)
    for got, want in zip(off_grads, on_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert "feature_group_count=8" in optimized_hlo(off_events[0].executable)
    assert "feature_group_count=8" not in optimized_hlo(on_events[0].executable)
    assert off_events[0].program.cache_key == on_events[0].program.cache_key  # the same lowered program
    assert off_events[0].key != on_events[0].key
