"""PyTorch's fused attention kernels and their backwards, decomposed as one agreeing pair, against the math
form of attention differentiated by eager autograd (the fused kernels other than the CPU's have no CPU
implementation, so they are traced on fake tensors and compared with what they compute)."""

import pytest
import torch

from tests.support import assert_close_tree, compile_fn
from tpucompile import driver
from tpucompile.frontend import fused_attention

aten = torch.ops.aten


def _math(query, key, value, mask=None, causal=False, scale=None):
    """Attention as matmul, mask, softmax, matmul: eager autograd differentiates it exactly."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    groups = query.shape[-3] // key.shape[-3]
    key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    scores = query @ key.transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, -1) @ value


def _inputs(batch=2, heads=4, kv_heads=4, length_q=12, length_k=12, dim=16, dtype=torch.float32):
    torch.manual_seed(0)
    return (torch.randn(batch, heads, length_q, dim, dtype=dtype), torch.randn(batch, kv_heads, length_k, dim,
            dtype=dtype), torch.randn(batch, kv_heads, length_k, dim, dtype=dtype))


def _compare(fn, reference, tensors, atol=2e-5):
    """``fn`` compiled against ``reference`` eagerly: the output and every input's gradient (the loss weights
    each output element differently, so a gradient mixed up between elements shows)."""
    def run(f, compile_it):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
        out = (compile_fn(f) if compile_it else f)(*leaves)
        weights = torch.linspace(-1, 2, out.numel()).reshape(out.shape)
        (out.float() * weights).sum().backward()
        return out.detach(), [t.grad for t in leaves if t.requires_grad]

    before = driver.graphs_compiled()
    actual = run(fn, True)
    assert driver.graphs_compiled() > before
    assert_close_tree(actual, run(reference, False), atol=atol, rtol=atol)


@pytest.mark.parametrize("case", ["plain", "causal", "bool-mask", "float-mask", "scale", "gqa", "cross"])
def test_cpu_flash_kernel_forward_and_backward_agree(case):
    shapes = {"gqa": dict(kv_heads=2), "cross": dict(length_k=7)}.get(case, {})
    query, key, value = _inputs(**shapes)
    mask = None
    if case == "bool-mask":
        mask = torch.rand(query.shape[-2], key.shape[-2]) > 0.3
        mask[:, 0] = True
    elif case == "float-mask":
        mask = torch.randn(2, 1, query.shape[-2], key.shape[-2])
    causal, scale = case == "causal", (0.3 if case == "scale" else None)

    def fused(q, k, v):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                 scale=scale)[0]

    _compare(fused, lambda q, k, v: _math(q, k, v, mask, causal, scale), (query, key, value))


def test_cpu_flash_kernel_in_eager_matches_the_math_reference():
    """The reference itself: PyTorch's CPU kernel gives the math form's values and gradients."""
    query, key, value = _inputs()
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    out = aten._scaled_dot_product_flash_attention_for_cpu(*leaves, 0.0, True)[0]
    out.sum().backward()
    reference = [t.clone().requires_grad_() for t in (query, key, value)]
    _math(*reference, causal=True).sum().backward()
    assert_close_tree([out, *(t.grad for t in leaves)],
                      [_math(query, key, value, causal=True), *(t.grad for t in reference)], atol=1e-5, rtol=1e-5)


def test_efficient_kernel_with_a_learned_bias():
    """The efficient kernel's bias is additive and takes a gradient of its own."""
    query, key, value = _inputs(length_q=40, length_k=40)  # the kernel's log-sum-exp is padded to 64 rows
    bias = torch.randn(2, 4, 40, 40)

    def fused(q, k, v, b):
        return aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.0, False)[0]

    _compare(fused, lambda q, k, v, b: _math(q, k, v, b), (query, key, value, bias))


@pytest.mark.parametrize("op", ["flash", "cudnn", "overrideable"])
def test_gpu_kernels_forward_and_backward_agree(op):
    query, key, value = _inputs()

    def fused(q, k, v):
        if op == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        if op == "cudnn":
            return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)[0]
        return aten._scaled_dot_product_fused_attention_overrideable(q, k, v, None, 0.0, True)[0]

    _compare(fused, lambda q, k, v: _math(q, k, v, causal=True), (query, key, value))


def test_fully_masked_rows_match_the_cpu_kernel():
    """A query row whose every key is masked: PyTorch's CPU kernel gives zeros there, and zero gradients."""
    query, key, value = _inputs()
    mask = torch.zeros(query.shape[-2], key.shape[-2])
    mask[3] = float("-inf")  # SDPA hands the kernel a boolean mask in this form

    def fused(q, k, v):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)[0]

    _compare(fused, fused, (query, key, value))


def test_rows_masked_by_the_most_negative_float_take_the_math_forms_gradient():
    """Hugging Face's additive masks (Falcon's ALiBi mask, padding) fill masked keys with the dtype's most
    negative finite value, so a padded query row sees every key at that value: a softmax of equal scores,
    which gives each key the same weight. ``scaled_dot_product_attention`` as a model calls it compiles to the
    gradient of that function, the math form's. PyTorch's CPU kernel, which eager runs, agrees in the forward
    but not in the backward: it recomputes the weights from a log-sum-exp whose ``log(keys)`` the mask's
    magnitude swallowed, and weighs every key 1 there (the fused pair, called by name, does the same:
    ``test_fully_masked_rows_match_the_cpu_kernel``)."""
    query, key, value = _inputs()
    mask = torch.randn(2, 1, query.shape[-2], key.shape[-2])
    mask[1, :, :3] = torch.finfo(torch.float32).min

    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    _compare(attention, lambda q, k, v: _math(q, k, v, mask), (query, key, value), atol=5e-5)


def test_bfloat16_saves_a_float32_log_sum_exp():
    query, key, value = _inputs(dtype=torch.bfloat16)
    out, lse = fused_attention.flash_for_cpu(query, key, value)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == query.shape[:-1]

    def fused(q, k, v):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]

    _compare(fused, lambda q, k, v: _math(q.float(), k.float(), v.float()).bfloat16(), (query, key, value),
             atol=2e-2)


def test_a_kernel_call_with_dropout_keeps_pytorchs_pair():
    """Dropout inside a fused kernel cannot be reproduced by a decomposition of its backward: both halves
    decline, so the pair stays PyTorch's own."""
    query, key, value = _inputs()
    assert fused_attention.flash_for_cpu(query, key, value, 0.1) is NotImplemented
    assert fused_attention.flash_for_cpu_backward(query, query, key, value, query, query[..., 0], 0.1,
                                                  False) is NotImplemented


@pytest.mark.parametrize("length", [128, 12])
def test_routing_to_the_kernel_op_where_it_fits(aten_ops, length):
    """With the kernel wanted, a fused call the kernel takes (lengths and head size multiples of 128, no
    mask) goes to ``tpucompile::attention`` and its backward, which on the CPU lower to the math form; a call
    it does not take keeps the math form."""
    query, key, value = _inputs(batch=1, heads=2, kv_heads=1, length_q=length, length_k=length, dim=128)

    def fused(q, k, v):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]

    torch._dynamo.reset()
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    out = torch.compile(fused, backend="tpucompile", fullgraph=True, options={"attention": "kernel"})(*leaves)
    out.sum().backward()
    reference = [t.clone().requires_grad_() for t in (query, key, value)]
    expected = _math(*reference, causal=True)
    expected.sum().backward()
    assert_close_tree([out, *(t.grad for t in leaves)], [expected, *(t.grad for t in reference)], atol=2e-5,
                      rtol=2e-5)
    kernel_ops = {torch.ops.tpucompile.attention.default, torch.ops.tpucompile.attention_backward.default}
    assert (kernel_ops <= aten_ops) == (length == 128)


def test_a_fused_backward_never_runs_on_values_its_forward_did_not_save(monkeypatch):
    """Take away the fused pairs' decompositions and the routing of ``F.multi_head_attention_forward``, so
    that PyTorch's own decomposition of the CPU kernel (which saves the probabilities where its backward reads
    a log-sum-exp) meets the fused backward in eager PyTorch, as it did before both existed: the compile
    refuses, naming the op and the value, instead of computing wrong gradients."""
    from tpucompile.errors import UnsupportedOpError
    from tpucompile.frontend import attention, decompositions

    monkeypatch.setattr(decompositions, "fused_attention_decompositions", lambda kernel: {})
    monkeypatch.setattr(attention, "_HIDING_ATTENTION", {})
    decompositions._table.cache_clear()
    try:
        module = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        x = torch.randn(2, 5, 16, requires_grad=True)
        compiled = torch.compile(module, backend="tpucompile", options={"fallback": "eager"})
        with pytest.raises(UnsupportedOpError, match=r"_scaled_dot_product_flash_attention_for_cpu_backward.*"
                                                     r"saved log-sum-exp is torch.float32 \[2, 2, 5, 5\]"):
            compiled(x, x, x, need_weights=False)[0].sum().backward()
    finally:
        monkeypatch.undo()
        decompositions._table.cache_clear()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "key-padding", "attn-mask", "both", "causal"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_trains_like_eager(batch_first, masks, need_weights):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first, kdim=24, vdim=20)
    batch, length_q, length_k = 3, 6, 7
    query = torch.randn(batch, length_q, 32)
    key, value = torch.randn(batch, length_k, 24), torch.randn(batch, length_k, 20)
    if not batch_first:
        query, key, value = (t.transpose(0, 1).contiguous() for t in (query, key, value))
    kwargs = {"need_weights": need_weights}
    if masks in ("key-padding", "both"):
        padding = torch.zeros(batch, length_k, dtype=torch.bool)
        padding[0, -2:] = True
        kwargs["key_padding_mask"] = padding
    if masks == "attn-mask":
        kwargs["attn_mask"] = torch.randn(length_q, length_k)
    if masks == "both":  # one mask type for both (mixing them is deprecated and warns)
        kwargs["attn_mask"] = torch.rand(length_q, length_k) > 0.8
    if masks == "causal":
        kwargs["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(length_q)[:, :length_k - 1]
        key, value = (t[:, :length_k - 1] if batch_first else t[:length_k - 1] for t in (key, value))
        kwargs["is_causal"] = True

    def run(fn):
        module.zero_grad()
        leaves = [t.clone().requires_grad_() for t in (query, key, value)]
        out, weights = fn(*leaves, **kwargs)
        loss = (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum()
        if weights is not None:
            loss = loss + (weights * torch.linspace(0, 1, weights.numel()).reshape(weights.shape)).sum()
        loss.backward()
        return [out, weights, *(t.grad for t in leaves), *(p.grad.clone() for p in module.parameters())]

    expected = run(module)
    before = driver.graphs_compiled()
    actual = run(torch.compile(module, backend="tpucompile", fullgraph=True))
    assert driver.graphs_compiled() > before
    assert_close_tree(actual, expected, atol=1e-5, rtol=1e-5)


def _eval_compare(module, *args, **kwargs):
    module.eval()
    with torch.no_grad():
        expected = module(*args, **kwargs)
        before = driver.graphs_compiled()
        actual = torch.compile(module, backend="tpucompile", fullgraph=True)(*args, **kwargs)
    assert driver.graphs_compiled() > before
    assert_close_tree(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mask", ["none", "padding", "causal"])
def test_transformer_encoder_layer_inference_fast_path(aten_ops, norm_first, mask):
    """In eval mode without gradients the layer is one fused kernel (``_transformer_encoder_layer_fwd``)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=norm_first,
                                             activation="gelu")
    x = torch.randn(3, 7, 16)
    kwargs = {}
    if mask == "padding":
        padding = torch.zeros(3, 7, dtype=torch.bool)
        padding[1, -3:] = True
        kwargs["src_key_padding_mask"] = padding
    elif mask == "causal":
        kwargs.update(src_mask=torch.nn.Transformer.generate_square_subsequent_mask(7), is_causal=True)
    _eval_compare(layer, x, **kwargs)
    if mask == "none":
        assert torch.ops.aten._transformer_encoder_layer_fwd.default not in aten_ops  # decomposed


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask", ["none", "padding", "attn"])
def test_multihead_attention_inference_fast_path(need_weights, mask):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(3, 7, 16)
    kwargs = {"need_weights": need_weights}
    if mask == "padding":
        kwargs["key_padding_mask"] = torch.tensor([[False] * 7, [False] * 4 + [True] * 3, [False] * 6 + [True]])
    elif mask == "attn":
        kwargs["attn_mask"] = torch.rand(7, 7) > 0.7
    _eval_compare(module, x, x, x, **kwargs)


def _train_compare(module, *args, **kwargs):
    """One training step's output and every parameter's and input's gradient, compiled against eager."""
    def run(fn):
        module.zero_grad()
        leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
        out = fn(*leaves, **kwargs)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return [out, *(a.grad for a in leaves if a.is_floating_point()), *(p.grad.clone() for p in module.parameters())]

    module.train()
    expected = run(module)
    before = driver.graphs_compiled()
    actual = run(torch.compile(module, backend="tpucompile", fullgraph=True))
    assert driver.graphs_compiled() > before
    assert_close_tree(actual, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_trains_like_eager(norm_first):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, norm_first=norm_first)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    padding = torch.zeros(3, 9, dtype=torch.bool)
    padding[2, -4:] = True
    _train_compare(encoder, torch.randn(9, 3, 32), src_key_padding_mask=padding)


def test_transformer_trains_like_eager():
    torch.manual_seed(0)
    model = torch.nn.Transformer(32, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                                 dropout=0.0, batch_first=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6)
    _train_compare(model, torch.randn(2, 8, 32), torch.randn(2, 6, 32), tgt_mask=causal, tgt_is_causal=True)


def test_multihead_attention_with_dropout_compiles_whole():
    """Dropout inside ``F.multi_head_attention_forward``: its attention is routed to the math form before
    autograd, so dropout is an ordinary op of the compiled graphs (``fallback`` is "error" in the tests) and
    the gradients are those of the mask drawn."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    out = torch.compile(module, backend="tpucompile", fullgraph=True)(x, x, x, need_weights=False)[0]
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_float64_is_computed_in_float64():
    """PyTorch's CPU kernel computes float64 attention in float64 (its log-sum-exp too): so does the pair."""
    query, key, value = _inputs(dtype=torch.float64)
    assert fused_attention.flash_for_cpu(query, key, value)[1].dtype == torch.float64

    def fused(q, k, v):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]

    _compare(fused, fused, (query, key, value), atol=1e-10)
