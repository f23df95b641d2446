"""Each graph pass on small hand-traced ATen graphs."""

from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from tpucompile.passes import eliminate_dead_code, lift_large_constants, remove_noop_views, run_passes

aten = torch.ops.aten


def _trace(fn, *inputs) -> torch.fx.GraphModule:
    """An ATen graph with ``meta["val"]`` on every node, as AOTAutograd produces."""
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_noop_views_are_removed_and_results_unchanged():
    def f(x):
        y = aten.view.default(x, [2, 3])  # same shape: a no-op
        y = aten.permute.default(y, [0, 1])  # identity permutation
        y = aten.expand.default(y, [2, 3])
        y = aten.slice.Tensor(y, 1, 0, 9223372036854775807)
        y = aten.mul.Tensor(y, 2)
        return aten.clone.default(aten.view.default(y, [3, 2]))

    x = torch.randn(2, 3)
    gm = _trace(f, x)
    expected = gm(x)
    removed = remove_noop_views(gm)
    assert removed == 5
    assert _targets(gm) == [aten.mul.Tensor, aten.view.default]
    torch.testing.assert_close(gm(x), expected)


def test_noop_copy_of_an_input_returned_as_output_is_kept():
    gm = _trace(lambda x: aten.clone.default(x), torch.randn(3))
    assert remove_noop_views(gm) == 0
    assert _targets(gm) == [aten.clone.default]


def test_real_views_and_casts_stay():
    def f(x):
        return aten._to_copy.default(aten.permute.default(x, [1, 0]), dtype=torch.float64)

    gm = _trace(f, torch.randn(2, 3))
    assert remove_noop_views(gm) == 0


def test_a_scatter_into_the_whole_dimension_is_its_source():
    def f(x, src, part):
        whole = aten.slice_scatter.default(x, src, 1, -7, 9223372036854775807)  # src covers x: the result is src
        partial = aten.slice_scatter.default(x, part, 1, -2, 9223372036854775807)  # a real write: stays
        return aten.add.Tensor(whole, partial)

    x, src, part = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 2)
    gm = _trace(f, x, src, part)
    expected = gm(x, src, part)
    assert remove_noop_views(gm) == 1
    assert _targets(gm) == [aten.slice_scatter.default, aten.add.Tensor]
    torch.testing.assert_close(gm(x, src, part), expected)
    returned = _trace(lambda x, src: aten.slice_scatter.default(x, src, 0, 0, 9223372036854775807),
                      torch.randn(3), torch.randn(3))
    assert remove_noop_views(returned) == 0, "returning the input itself would alias it"


def test_dead_code_is_eliminated():
    def f(x):
        aten.sin.default(x)  # unused
        return aten.cos.default(x)

    gm = _trace(f, torch.randn(3))
    assert aten.sin.default in _targets(gm)
    assert eliminate_dead_code(gm)
    assert _targets(gm) == [aten.cos.default]


def _graph_with_constant(values: torch.Tensor) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    const = graph.get_attr("table")
    graph.output(graph.call_function(aten.add.Tensor, (x, const)))
    root = torch.nn.Module()
    root.table = values
    gm = torch.fx.GraphModule(root, graph)
    with FakeTensorMode() as mode:
        x.meta["val"] = mode.from_tensor(torch.empty(values.shape))
    return gm


def test_large_constants_become_trailing_arguments():
    table = torch.arange(20.0).reshape(4, 5)
    gm = _graph_with_constant(table)
    lifted = lift_large_constants(gm, limit=10)
    assert len(lifted) == 1 and lifted[0] is not None
    torch.testing.assert_close(lifted[0], table)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders] == ["x", "lifted_table"]
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)
    x = torch.randn(4, 5)
    torch.testing.assert_close(gm(x, *lifted), x + table)


def test_small_constants_stay_embedded():
    gm = _graph_with_constant(torch.arange(4.0))
    assert lift_large_constants(gm, limit=10) == []
    assert any(n.op == "get_attr" for n in gm.graph.nodes)


def test_run_passes_reports_lifted_constants():
    gm = _graph_with_constant(torch.arange(20.0))
    result = run_passes(gm, embed_constant_limit=4)
    assert len(result.lifted_constants) == 1


def test_attention_is_rewritten_to_its_math_form():
    import torch.nn.functional as F

    from tpucompile.frontend import rewrite_attention

    def attend(q, k, v, additive_mask, keep_mask):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask, scale=0.3)
        c = F.scaled_dot_product_attention(q, k, v, attn_mask=keep_mask)
        return a, b, c

    gm = torch.fx.symbolic_trace(attend)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    mask = torch.randn(5, 7)
    mask_bool = mask > 0
    mask_bool[:, 0] = True  # no fully masked row
    expected = attend(q, k, v, mask, mask_bool)
    assert rewrite_attention(gm) == 3
    torch.testing.assert_close(gm(q, k, v, mask, mask_bool), expected, atol=1e-5, rtol=1e-5)


def test_attention_with_grouped_query_heads():
    import torch.nn.functional as F

    from tpucompile.frontend.decompositions import scaled_dot_product_attention

    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    actual = scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
