"""Masks proved from the graph that builds them (``frontend.attention_masks``), and the attention calls the
proof sends to the kernel op.

Each case captures Dynamo's graph of a function that builds a mask and calls attention, rewrites it as a TPU
compile would, and runs the rewritten graph eagerly: the kernel op's eager implementation computes the mask
the proof described, so equal values against the unrewritten function check the proof on those inputs,
including rows that see no key. The cases that must not be proved check that they keep the math form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpucompile.frontend.attention import rewrite_attention

BATCH, HEADS, KV_HEADS, LENGTH, HEAD_DIM = 2, 4, 2, 128, 32


def _indices(length):
    return torch.arange(length)[:, None], torch.arange(length)[None, :]


def hf_causal_padding(q, k, v, pad):
    """transformers' ``sdpa_mask``: index tensors, a per-batch padding gather, ``&``, expand."""
    batch_idx = torch.arange(q.shape[0])[:, None, None, None]
    q_idx = torch.arange(LENGTH)[None, None, :, None]
    kv_idx = torch.arange(LENGTH)[None, None, None, :]
    keep = q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx)
    keep = keep & pad.to(torch.bool)[batch_idx, kv_idx]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.expand(q.shape[0], -1, LENGTH, LENGTH))


def tril_of_ones(q, k, v, pad):
    keep = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def sliding_window(q, k, v, pad):
    rows, columns = _indices(LENGTH)
    keep = (columns <= rows) & (columns > rows - 40)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def additive_padding(q, k, v, pad):
    keep = pad.bool()[:, None, None, :]
    bias = torch.where(keep, 0.0, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=False)


def window_with_padding_and_is_causal(q, k, v, pad):
    rows, columns = _indices(LENGTH)
    keep = ~(rows - columns >= 24) & pad.bool()[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def band_above_the_diagonal(q, k, v, pad):
    rows, columns = _indices(LENGTH)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=columns <= rows + 3)


def repeated_keys(q, k, v, pad):
    """Hugging Face's ``repeat_kv``: the kernel reads the unrepeated heads."""
    def repeat(x):
        b, heads, n, d = x.shape
        return x[:, :, None, :, :].expand(b, heads, HEADS // heads, n, d).reshape(b, HEADS, n, d)
    return F.scaled_dot_product_attention(q, repeat(k), repeat(v), is_causal=True)


PROVED = {
    hf_causal_padding: "causal & padding",
    tril_of_ones: "causal",
    sliding_window: "band [-39, +0]",
    additive_padding: "padding",
    window_with_padding_and_is_causal: "band [-23, +inf] & padding",
    band_above_the_diagonal: "band [-inf, +3]",
    repeated_keys: "causal",
}


def random_mask(q, k, v, pad):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=pad.bool()[:, None, :, None] | (pad > 5)[:, None, None])


def diagonal_hidden(q, k, v, pad):
    rows, columns = _indices(LENGTH)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=columns < rows)


def padding_read_by_query(q, k, v, pad):
    batch_idx = torch.arange(q.shape[0])[:, None, None, None]
    q_idx = torch.arange(LENGTH)[None, None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=pad.bool()[batch_idx, q_idx])


def causal_or_padding(q, k, v, pad):
    rows, columns = _indices(LENGTH)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(columns <= rows) | pad.bool()[:, None, None, :])


def additive_finite_minimum(q, k, v, pad):
    bias = torch.where(pad.bool()[:, None, None, :], 0.0, torch.finfo(torch.float32).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def shifted_by_data(q, k, v, pad):
    rows, columns = _indices(LENGTH)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=columns <= rows + pad.sum())


def padding_shifted(q, k, v, pad):
    keep = pad.bool()[:, 1:]
    keep = torch.cat([keep, keep[:, :1]], dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


NOT_PROVED = [random_mask, diagonal_hidden, padding_read_by_query, causal_or_padding, additive_finite_minimum,
              shifted_by_data]


def _inputs(kv_heads=HEADS):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, kv_heads, LENGTH, HEAD_DIM, generator=generator) for _ in range(2))
    pad = torch.ones(BATCH, LENGTH, dtype=torch.long)
    pad[1, :50] = 0  # left padding: under a causal mask rows 0..49 of batch row 1 see no key
    pad[0, 100:] = 0  # right padding
    return q, k, v, pad


def _rewritten(fn, inputs):
    """The decisions written on ``fn``'s attention nodes, and ``fn`` run through its rewritten graph."""
    decisions, results = [], []

    def backend(gm, example_inputs):
        rewrite_attention(gm, kernel=True)
        decisions.extend(n.meta["attention"] for n in gm.graph.nodes if "attention" in n.meta)
        return gm.forward

    results.append(torch.compile(fn, backend=backend, fullgraph=True)(*inputs))
    return decisions, results[0]


@pytest.mark.parametrize("fn", list(PROVED), ids=lambda fn: fn.__name__)
def test_proved_masks_go_to_the_kernel_and_mean_what_the_graph_built(fn):
    inputs = _inputs(KV_HEADS if fn is repeated_keys else HEADS)
    decisions, actual = _rewritten(fn, inputs)
    assert len(decisions) == 1 and decisions[0].startswith(f"kernel: {PROVED[fn]}"), decisions
    expected = fn(*inputs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn", NOT_PROVED, ids=lambda fn: fn.__name__)
def test_masks_not_proved_keep_the_math_form(fn):
    inputs = _inputs()
    decisions, actual = _rewritten(fn, inputs)
    assert len(decisions) == 1 and decisions[0].startswith("math: its mask is not proved"), decisions
    torch.testing.assert_close(actual, fn(*inputs), atol=1e-5, rtol=1e-5, equal_nan=True)


def test_a_padding_mask_built_otherwise_is_taken_as_data_not_as_padding():
    """A (batch, key) boolean tensor computed by ops the proof does not follow is read as the run-time value
    it is: the kernel's padding input is that tensor, so the mask stays exact."""
    inputs = _inputs()
    decisions, actual = _rewritten(padding_shifted, inputs)
    assert len(decisions) == 1 and decisions[0].startswith("kernel: padding"), decisions
    torch.testing.assert_close(actual, padding_shifted(*inputs), atol=1e-5, rtol=1e-5)


def test_the_rewritten_graph_no_longer_builds_the_mask():
    """The mask's computation is dropped once the kernel takes the call: no (batch, 1, q, k) tensor is built."""
    graphs = []

    def backend(gm, example_inputs):
        rewrite_attention(gm, kernel=True)
        graphs.append(gm)
        return gm.forward

    torch.compile(hf_causal_padding, backend=backend, fullgraph=True)(*_inputs())
    shapes = [tuple(n.meta["example_value"].shape) for n in graphs[0].graph.nodes
              if isinstance(n.meta.get("example_value"), torch.Tensor)]
    assert (BATCH, 1, LENGTH, LENGTH) not in shapes and (1, 1, LENGTH, LENGTH) not in shapes, shapes
