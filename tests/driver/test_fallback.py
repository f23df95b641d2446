"""Ops without a lowering run in eager PyTorch between compiled regions, forward and backward."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn

import tpucompile
from tests.support import assert_close_tree, compile_fn
from tpucompile import driver


@torch.library.custom_op("tpucompile_test::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.detach().numpy() * 2)  # numpy: the implementation cannot be traced into the graph


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def _twice_backward(ctx, grad):
    return grad * 2


_twice.register_autograd(_twice_backward)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.ops.tpucompile_test.twice(h)  # runs eagerly
        return self.fc2(h).softmax(-1)


def test_fallback_in_the_middle_of_a_model_forward_and_backward():
    torch.manual_seed(0)
    eager = _Model()
    model = _Model()
    model.load_state_dict(eager.state_dict())
    x = torch.randn(4, 6)
    before = driver.graphs_compiled()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="tpucompile", fullgraph=True, options={"fallback": "eager"})
        out = compiled(x)
        out.pow(2).sum().backward()
    assert driver.graphs_compiled() >= before + 2  # a forward and a backward graph
    expected = eager(x)
    expected.pow(2).sum().backward()
    assert_close_tree(out, expected)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert_close_tree(p.grad, q.grad)
    messages = [str(w.message) for w in caught if issubclass(w.category, tpucompile.TpuCompileWarning)]
    # One warning per op kind and process, naming the op and the user's line.
    assert len([m for m in messages if "tpucompile_test.twice.default" in m]) == 1, messages
    assert any(f"{os.path.basename(__file__)}:" in m and "runs eagerly" in m for m in messages), messages


def test_compiled_regions_really_run_compiled():
    def f(x):
        y = x.exp() + 1
        y = torch.ops.tpucompile_test.twice(y)
        return y.log() * 3

    events = []
    remove = driver.add_observer(events.append)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = torch.rand(5)
            assert_close_tree(compile_fn(f, fallback="eager")(x), f(x))
    finally:
        remove()
    texts = [e.program.text(debug_info=False) for e in events]
    assert any("stablehlo.exponential" in t for t in texts)
    assert any("stablehlo.log" in t for t in texts)


def test_fallback_error_option_raises_with_the_op_and_line():
    def f(x):
        return torch.ops.tpucompile_test.twice(x + 1)  # the failing line

    with pytest.raises(Exception) as info:
        compile_fn(f, fallback="error")(torch.randn(3))
    message = str(info.value)
    assert "UnsupportedOpError" in message and "tpucompile_test.twice.default" in message
    assert "the failing line" in message and "fallback" in message


def test_unsupported_dtype_falls_back():
    def f(x):
        z = torch.view_as_complex(x.reshape(3, 2) * 2)
        return torch.view_as_real(z * z).sum(-1) + 1

    x = torch.randn(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_close_tree(compile_fn(f, fallback="eager")(x), f(x))
