"""PyTorch's inference fast paths for its attention modules, decomposed into the ops they fuse.

In eval mode without gradients, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` call one fused
CPU/CUDA kernel each (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``), which Dynamo
records whole. They have no autograd formula (the fast path is taken only where nothing needs a gradient),
so decomposing them below autograd is exact: the same projections, attention and layer norms as the
modules' ordinary forward, written once here.

Their masks follow the fast path's conventions: a boolean mask is True where a key is masked out (the
opposite of ``scaled_dot_product_attention``'s), a float mask is added to the scores, and ``mask_type``
says how it is laid out: 0 (or None for a 2-d mask) ``(query, key)``, 1 a key padding mask ``(batch, key)``,
2 ``(batch, heads, query, key)`` or broadcastable to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _scores_mask(mask: torch.Tensor | None, mask_type: int | None) -> torch.Tensor | None:
    """The mask as an additive float term broadcastable to ``(batch, heads, query, key)``, or a boolean
    tensor True where masked out; None without a mask."""
    if mask is None:
        return None
    if mask_type == 1:
        return mask[:, None, None, :]
    if mask.dim() == 3:
        return mask[:, None]
    return mask


def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                proj_bias, mask=None, need_weights=True, average_attn_weights=True,
                                mask_type=None):
    """``(output, weights)`` of batch-first multi-head attention with packed input projections; the weights
    are averaged over heads with ``average_attn_weights``, empty without ``need_weights``."""
    weight_q, weight_k, weight_v = qkv_weight.chunk(3)
    bias_q, bias_k, bias_v = qkv_bias.chunk(3)
    head_dim = embed_dim // num_head

    def heads(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, bias).unflatten(-1, (num_head, head_dim)).transpose(1, 2)

    q, k, v = heads(query, weight_q, bias_q), heads(key, weight_k, bias_k), heads(value, weight_v, bias_v)
    scores = torch.matmul(q, k.transpose(-2, -1)) * head_dim ** -0.5
    additive = _scores_mask(mask, mask_type)
    if additive is not None:
        scores = scores.masked_fill(additive, float("-inf")) if additive.dtype == torch.bool else scores + additive
    weights = torch.softmax(scores, dim=-1)
    out = torch.matmul(weights, v).transpose(1, 2).flatten(-2)
    out = F.linear(out, proj_weight, proj_bias)
    if not need_weights:
        return out, query.new_empty(0)
    return out, weights.mean(1) if average_attn_weights else weights


def transformer_encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                              norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                              ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """One ``nn.TransformerEncoderLayer`` step (batch-first): self-attention and the feed-forward block,
    each with its residual, the layer norms before (``norm_first``) or after them."""
    def norm1(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x):
        return F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    def attend(x):
        return native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                           proj_bias, mask, False, True, mask_type)[0]

    def feed_forward(x):
        hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(hidden) if use_gelu else F.relu(hidden), ffn_weight_2, ffn_bias_2)

    if norm_first:
        x = src + attend(norm1(src))
        return x + feed_forward(norm2(x))
    x = norm1(src + attend(src))
    return norm2(x + feed_forward(x))


def fused_layer_decompositions() -> dict[torch._ops.OpOverload, object]:
    aten = torch.ops.aten
    return {aten._native_multi_head_attention.default: native_multi_head_attention,
            aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer}
