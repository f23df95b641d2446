"""``sum_concatenations_by_part``: a sum over a concatenation whose concatenated dim it keeps is taken per
part, on hand-traced ATen graphs (which sums it rewrites and which it leaves) and on a fused query/key/value
projection's bias gradient compiled end to end, against eager and against the option turned off."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from tpucompile.passes import sum_concatenations_by_part
from tpucompile.passes.concat_sums import _reduced_source_dims

aten = torch.ops.aten


def _trace(fn, *inputs) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _sums_of_concatenations(gm: torch.fx.GraphModule) -> int:
    def source(node):
        value = node.args[0]
        return value.args[0] if value.target in (aten.view.default, aten._unsafe_view.default) else value

    return sum(n.op == "call_function" and n.target is aten.sum.dim_IntList and source(n).target is aten.cat.default
               for n in gm.graph.nodes)


def _parts(*shapes, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


@pytest.mark.parametrize("keepdim", [True, False])
def test_the_bias_gradient_of_a_fused_projection_is_summed_per_part(keepdim):
    """The backward of ``linear(x, w, b).split(...)`` on (batch, sequence, features): the three gradients
    concatenated, flattened to rows and summed over them."""
    def f(a, b, c):
        rows = aten.view.default(aten.cat.default([a, b, c], 2), [12, 30])
        return aten.sum.dim_IntList(rows, [0], keepdim)

    inputs = _parts((3, 4, 8), (3, 4, 8), (3, 4, 14))
    gm = _trace(f, *inputs)
    expected = gm(*inputs)
    assert _sums_of_concatenations(gm) == 1
    assert sum_concatenations_by_part(gm) == 1
    assert _sums_of_concatenations(gm) == 0
    assert [n.meta["val"].shape for n in gm.graph.nodes if n.target is aten.sum.dim_IntList] == [(8,), (8,), (14,)]
    actual = gm(*inputs)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected)


def test_a_sum_over_several_dims_without_a_view_and_a_negative_dim():
    def f(a, b):
        return aten.sum.dim_IntList(aten.cat.default([a, b], -2), [0, -1])

    inputs = _parts((2, 3, 5), (2, 4, 5))
    gm = _trace(f, *inputs)
    expected = gm(*inputs)
    assert sum_concatenations_by_part(gm) == 1
    torch.testing.assert_close(gm(*inputs), expected)


@pytest.mark.parametrize("case", ["over the concatenated dim", "a view mixing kept and summed dims", "a dtype",
                                  "parts of another dtype"])
def test_sums_it_cannot_split_are_left_alone(case):
    a, b = _parts((2, 3, 4), (2, 3, 4))
    if case == "over the concatenated dim":
        def f(a, b):
            return aten.sum.dim_IntList(aten.cat.default([a, b], 1), [1])
    elif case == "a view mixing kept and summed dims":
        def f(a, b):  # dims 0 and 1 of the concatenation merge, and only part of the merge is summed
            return aten.sum.dim_IntList(aten.view.default(aten.cat.default([a, b], 2), [3, 2, 8]), [0])
    elif case == "a dtype":
        def f(a, b):
            return aten.sum.dim_IntList(aten.cat.default([a, b], 2), [0], dtype=torch.float64)
    else:
        b = b.to(torch.float64)

        def f(a, b):
            return aten.sum.dim_IntList(aten.cat.default([a, b], 2), [0])
    gm = _trace(f, a, b)
    assert sum_concatenations_by_part(gm) == 0


def test_dims_are_followed_through_a_reshape():
    assert _reduced_source_dims((8, 512, 3072), (4096, 3072), {0}) == {0, 1}
    assert _reduced_source_dims((8, 512, 3072), (8, 512, 3072), {0, 1}) == {0, 1}
    assert _reduced_source_dims((2, 3, 4), (6, 2, 2), {1, 2}) == {2}
    assert _reduced_source_dims((2, 3, 4), (3, 2, 4), {0}) is None
    assert _reduced_source_dims((1, 6, 4), (6, 1, 4), {0, 1}) == {0, 1}  # a size-1 dim summed or not alike


class _FusedProjection(nn.Module):
    """A query/key/value projection as one ``Linear`` split in three, as GPT-2 and the example GPT write it."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.width, dim=2)
        return (q.tanh() * k.sigmoid() + v.square()).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_fused_projection_trains_like_eager_with_the_sums_per_part_and_without(compile_events, dtype):
    torch.manual_seed(0)
    model = _FusedProjection().to(dtype)
    x = torch.randn(4, 16, 32).to(dtype)
    model(x).float().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    grads = {}
    for by_part in (True, False):
        model.zero_grad()
        compile_events.clear()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tpucompile", options={"sum_concat_by_part": by_part,
                                                                        "cache_mode": "off"})
        compiled(x).float().backward()
        backward = next(e.graph for e in compile_events if e.name.endswith("(backward)"))
        assert _sums_of_concatenations(backward) == (0 if by_part else 1)
        grads[by_part] = {name: p.grad.clone() for name, p in model.named_parameters()}
        for name, grad in grads[by_part].items():
            torch.testing.assert_close(grad, expected[name], **tolerance)
    for name in expected:
        torch.testing.assert_close(grads[True][name], grads[False][name], **tolerance)
