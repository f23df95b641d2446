"""``save_bases_of_transposes``: a transposed view the partition saves for the backward crosses as its base and
is transposed again in the backward. On partitions AOTAutograd makes of small functions (which views move,
which stay, a view whose base is saved too), run as the graphs they are, and end to end on Hugging Face's
GPT-2 with the option on and off, against eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition

from tpucompile.frontend import activation_budget
from tpucompile.passes.saved_transposes import TRANSPOSING_VIEWS, save_bases_of_transposes


def _partitioned(fn, *inputs):
    """``fn`` through AOTAutograd with the pass after the min-cut partition; the graphs run as they are. Returns
    the gradients of ``fn(...).sum()``, and the saved values before and after the pass."""
    seen = {}

    def partition(joint, joint_inputs, **kwargs):
        forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        count = kwargs["num_fwd_outputs"]
        seen["before"] = _described(forward.graph.output_node().args[0][count:])
        seen["changed"] = save_bases_of_transposes(forward, backward, count)
        seen["after"] = _described(forward.graph.output_node().args[0][count:])
        return forward, backward

    compiled = aot_function(fn, fw_compiler=lambda gm, _: make_boxed_func(gm),
                            bw_compiler=lambda gm, _: make_boxed_func(gm), partition_fn=partition)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    compiled(*leaves).sum().backward()
    return [leaf.grad for leaf in leaves], seen


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(4, 8, 16, generator=generator), torch.randn(16, 32, generator=generator),
            torch.randn(32, generator=generator))


def _block(x, w, b):
    """GPT-2's MLP in miniature: ``addmm`` over the flattened tokens, whose weight gradient reads ``x.t()``."""
    h = torch.addmm(b, x.view(-1, 16), w)
    return F.gelu(h).view(4, 8, 32)


def _attention(x, w, b):
    """Queries and keys transposed to (batch, heads, tokens, dim), as attention takes them."""
    q = (x @ w[:, :16] + b[:16]).view(4, 8, 2, 8).transpose(1, 2)
    k = (x @ w[:, 16:] + b[16:]).view(4, 8, 2, 8).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, k)


def _described(saved) -> list[tuple[str, bool]]:
    """Per saved value: its name, and whether it is a transposing view of a value the forward computed (a
    chain of such views ending at a graph input is not)."""
    described = []
    for node in saved:
        root = node
        while root.op == "call_function" and root.target in TRANSPOSING_VIEWS:
            root = root.args[0]
        described.append((node.name, root is not node and root.op != "placeholder"))
    return described


def _transposed_values(saved: list[tuple[str, bool]]) -> list[str]:
    return [name for name, transposed in saved if transposed]


def _expected_gradients(fn):
    leaves = [t.clone().requires_grad_() for t in _inputs()]
    return torch.autograd.grad(fn(*leaves).sum(), leaves)


def test_saved_transposes_read_by_products_cross_as_their_bases():
    """GPT-2's MLP: every saved transposed value is a product's operand in the backward, and each crosses as its
    base; the gradients are the same."""
    grads, seen = _partitioned(_block, *_inputs())
    assert _transposed_values(seen["before"]), "the partition saved no transposed value: nothing is tested"
    assert seen["changed"] == len(_transposed_values(seen["before"]))
    assert not _transposed_values(seen["after"])
    for got, want in zip(grads, _expected_gradients(_block), strict=True):
        torch.testing.assert_close(got, want)


def test_saved_transposes_read_by_other_ops_stay_views():
    """The queries and keys transposed to heads are read by the fused attention's backward, which would need
    them in that order again: they stay saved as views. The projections' transposed inputs, read by products,
    cross as their bases."""
    grads, seen = _partitioned(_attention, *_inputs())
    before, after = _transposed_values(seen["before"]), _transposed_values(seen["after"])
    heads = [name for name in before if name.startswith("transpose")]
    assert heads and after == heads
    assert seen["changed"] == len(before) - len(heads) > 0
    for got, want in zip(grads, _expected_gradients(_attention), strict=True):
        torch.testing.assert_close(got, want)


def _graph(build) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    build(graph)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_view_whose_base_is_saved_too_is_dropped():
    """The forward saves ``a = sin(x)`` and ``a.t()``: the view is not saved a second time, and the backward
    takes it of ``a``'s placeholder."""
    x = torch.randn(4, 6)

    def forward_graph(graph):
        placeholder = graph.placeholder("primals_1")
        placeholder.meta["val"] = x
        a = graph.call_function(torch.ops.aten.sin.default, (placeholder,), name="sin")
        a.meta["val"] = x.sin()
        t = graph.call_function(torch.ops.aten.t.default, (a,), name="t")
        t.meta["val"] = x.sin().t()
        total = graph.call_function(torch.ops.aten.sum.default, (a,))
        graph.output((total, a, t))

    def backward_graph(graph):
        a = graph.placeholder("sin")
        t = graph.placeholder("t")
        tangent = graph.placeholder("tangents_1")
        product = graph.call_function(torch.ops.aten.mm.default, (t, a))
        graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (product, tangent)),))

    forward, backward = _graph(forward_graph), _graph(backward_graph)
    expected = backward(x.sin(), x.sin().t(), torch.tensor(2.0))
    assert save_bases_of_transposes(forward, backward, 1) == 1
    _, *saved = forward(x)
    assert len(saved) == 1 and [n.name for n in backward.graph.nodes if n.op == "placeholder"] == ["sin", "tangents_1"]
    torch.testing.assert_close(backward(*saved, torch.tensor(2.0)), expected)


def test_a_transposed_input_stays_a_view():
    """A view of a graph input (here two: ``linear`` of ``w.t()`` saves ``w.t().t()``) is left saved as it is:
    the input may change in place before the backward runs. The transposed ``sin(x)`` beside it crosses as its
    base."""
    def fn(x, w, b):
        return torch.nn.functional.linear(torch.sin(x), w.t(), b)

    grads, seen = _partitioned(fn, *_inputs())
    views_of_inputs = [name for name, _ in seen["before"] if name.startswith("t")
                       and (name, False) in seen["before"]]
    assert seen["changed"] == 1 and not _transposed_values(seen["after"])
    assert views_of_inputs and all((name, False) in seen["after"] for name in views_of_inputs)
    inputs = [t.clone().requires_grad_() for t in _inputs()]
    fn(*inputs).sum().backward()
    for got, leaf in zip(grads, inputs, strict=True):
        torch.testing.assert_close(got, leaf.grad)


@pytest.mark.parametrize("on", [True, False], ids=["bases", "views"])
def test_gpt2_trains_like_eager_with_saved_transposes_either_way(on, seeded, monkeypatch):
    """Hugging Face's GPT-2 (``Conv1D`` products, attention's transposed heads) saves transposed values for its
    backward; a training step with the option on (which moves some) and off gives eager's loss and
    gradients."""
    transformers = pytest.importorskip("transformers")
    moved = []
    monkeypatch.setattr(activation_budget, "save_bases_of_transposes",
                        lambda *graphs, **how: moved.append(save_bases_of_transposes(*graphs, **how)) or moved[-1])
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=4, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).train()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="tpucompile", options={"saved_transposes_as_bases": on})
    ids = torch.randint(0, 96, (2, 12))
    expected = model(input_ids=ids, labels=ids).loss
    got = compiled(input_ids=ids, labels=ids).loss
    expected.backward()
    got.backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(twin.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert (sum(moved) > 0) if on else not moved
