"""Grouped-query attention in its math form (``grouped_query_attention``, on by default): where the queries are
few against the keys (a decoding step), keys and values that the model repeated per query head (Hugging Face's
``repeat_kv``) or passed with ``enable_gqa`` are used unrepeated, each key/value head's group of queries taken
as rows of one product. Against eager PyTorch and against the option off (the repeated form), forward and every
input's gradient, for each kind of mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_close_tree
from tpucompile import backend


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``: each key/value head repeated for its group of query heads."""
    batch, heads, length, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def _repeat_kv_unsqueezed(x: torch.Tensor, groups: int) -> torch.Tensor:
    batch, heads, length, dim = x.shape
    return x.unsqueeze(2).expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def _attention(case: str, groups: int):
    """The attention a model would write for ``case``: the query laid out as a projection gives it (heads
    transposed out of the sequence), keys and values repeated per query head."""
    def attention(query, key, value, mask):
        query = query.transpose(1, 2)  # (batch, length, heads, dim) -> (batch, heads, length, dim)
        if case == "enable-gqa":
            return F.scaled_dot_product_attention(query, key, value, enable_gqa=True)
        repeat = _repeat_kv_unsqueezed if case == "unsqueezed" else _repeat_kv
        key, value = repeat(key, groups), repeat(value, groups)
        if case == "causal":
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=0.3)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    return attention


def _inputs(case: str, heads: int, key_heads: int) -> tuple[torch.Tensor, ...]:
    batch, dim = 2, 16
    length_q, length_k = (1, 9) if case == "decode" else (3, 12)
    query = torch.randn(batch, length_q, heads, dim)
    key, value = torch.randn(batch, key_heads, length_k, dim), torch.randn(batch, key_heads, length_k, dim)
    if case == "bool-mask":  # Hugging Face's causal mask with the second sequence's first two tokens padded
        mask = torch.ones(length_q, length_k, dtype=torch.bool).tril().expand(batch, 1, length_q, length_k).clone()
        mask[1, :, :, :2] = False
        mask[1, :, :2, 0] = True  # no row left without a key
    elif case == "float-mask":
        mask = torch.randn(batch, 1, length_q, length_k)
    elif case == "per-head-mask":
        mask = torch.rand(batch, heads, length_q, length_k) > 0.3
        mask[..., 0] = True
    else:
        mask = None
    return query, key, value, mask


def _run(function, tensors, options=None, dynamic_query=False):
    """``function`` on fresh leaves (compiled with ``options`` unless None; ``dynamic_query``: the query's
    length marked dynamic): its output and every differentiable input's gradient, the loss weighting each
    output element differently."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in tensors]
    if dynamic_query:
        torch._dynamo.mark_dynamic(leaves[0], 2)
    if options is not None:
        torch._dynamo.reset()
        function = torch.compile(function, backend="tpucompile", fullgraph=True, options=options)
    out = function(*leaves)
    (out * torch.linspace(-1, 2, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), *(t.grad for t in leaves if t is not None and t.requires_grad)]


@pytest.fixture
def routed(monkeypatch) -> list[str]:
    """The attention routing each compiled graph's calls were given (``"attention"`` in their meta)."""
    seen: list[str] = []
    original = backend.rewrite_attention

    def recording(gm, *args, **kwargs):
        count = original(gm, *args, **kwargs)
        seen.extend(n.meta["attention"] for n in gm.graph.nodes if "attention" in n.meta)
        return count

    monkeypatch.setattr(backend, "rewrite_attention", recording)
    return seen


_CASES = ["no-mask", "unsqueezed", "causal", "bool-mask", "float-mask", "per-head-mask", "decode", "enable-gqa"]


@pytest.mark.parametrize(("case", "heads", "key_heads"), [
    *((case, 4, 2) for case in _CASES), ("bool-mask", 6, 1), ("decode", 6, 1)])
def test_grouped_math_form_matches_eager_and_the_repeated_form(case, heads, key_heads, routed, seeded):
    tensors = _inputs(case, heads, key_heads)
    attention = _attention(case, heads // key_heads)
    expected = _run(attention, tensors)
    grouped = _run(attention, tensors, {"attention": "math", "cache_mode": "off"})
    assert routed and all(r.startswith("math, grouped-query") for r in routed), routed
    routed.clear()
    repeated = _run(attention, tensors, {"attention": "math", "cache_mode": "off", "grouped_query_attention": False})
    assert routed and not any("grouped" in r for r in routed), routed
    assert_close_tree(grouped, expected, atol=2e-5, rtol=2e-5)
    assert_close_tree(grouped, repeated, atol=2e-5, rtol=2e-5)


def test_heads_repeated_otherwise_keep_the_repeated_form(routed, seeded):
    """Keys repeated in another layout (each head's copies apart, as ``repeat`` gives) do not serve groups of
    consecutive query heads: the call keeps the math form on the tensors it was given."""
    query, key, value = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))

    expected = _run(attention, (query, key, value))
    got = _run(attention, (query, key, value), {"attention": "math", "cache_mode": "off"})
    assert routed and not any("grouped" in r for r in routed), routed
    assert_close_tree(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lengths", ["as-many-queries-as-keys", "runtime-sized-queries"])
def test_long_or_runtime_sized_queries_keep_the_repeated_form(lengths, routed, seeded):
    """With as many queries as keys (a training step, a prompt) the scores are the traffic, not the keys: the
    repeated form stays; so it does for a runtime-sized query length (under buckets its rows would merge the
    padded length inside the heads)."""
    query, key, value = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    if lengths == "runtime-sized-queries":
        query, key, value = query[:, :, :3], key.repeat(1, 1, 2, 1), value.repeat(1, 1, 2, 1)  # 3 against 16

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), _repeat_kv(v, 2))

    expected = _run(attention, (query, key, value))
    got = _run(attention, (query, key, value), {"attention": "math", "cache_mode": "off"},
               dynamic_query=lengths == "runtime-sized-queries")
    assert routed and not any("grouped" in r for r in routed), routed
    assert_close_tree(got, expected, atol=2e-5, rtol=2e-5)
