"""PyTorch's fused attention kernels, forward and backward, decomposed so that the two agree.

``scaled_dot_product_attention`` is decomposed above autograd only where Dynamo's graph shows the call
(``attention.rewrite_attention``). A call hidden inside another op (``F.multi_head_attention_forward``, which
Dynamo keeps whole) dispatches to a fused kernel (``_scaled_dot_product_flash_attention_for_cpu`` on the CPU,
the efficient, flash, cuDNN or "overrideable" kernels elsewhere) whose autograd formula is another fused
kernel. Autograd records that backward op before the decomposition table is consulted, so a forward
decomposed here is paired with the fused backward: the pair must agree on what the forward saves. PyTorch's
own decomposition of the CPU kernel returns the attention probabilities where the kernel returns the
log-sum-exp of each score row, so the backward would read garbage.

Each forward here returns the kernel's outputs as the kernel defines them: the attention output and the
log-sum-exp (float32, in the kernel's shape) of each query row of the scaled, masked scores; the backward
recomputes the probabilities from it, ``exp(scores - lse)``, as a flash-attention backward does. Only the
output and one float per row are saved, never the scores. Where a TPU kernel is wanted and takes the call,
both go to ``tpucompile::attention`` and its backward, which lower to the Pallas kernel there.

A kernel call with dropout keeps the fused pair (``NotImplemented`` from both halves): the kernel draws its
own dropout mask, which no decomposition can reproduce in the backward, so both halves run as PyTorch's
kernels, the backward on the values the kernel's forward saved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpucompile.contracts import attention_ops
from tpucompile.contracts.attention_ops import expand_heads, fold_heads, probabilities

aten = torch.ops.aten


def _scale(query: torch.Tensor, scale: float | None) -> float:
    return query.shape[-1] ** -0.5 if scale is None else scale


def _masked_scores(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                   scale: float) -> torch.Tensor:
    """The scaled scores in float32 (float64 for float64 inputs), with the causal (top-left aligned) and
    boolean or additive masks."""
    dtype = _computation_dtype(query)
    scores = torch.matmul(query, expand_heads(query, key).transpose(-2, -1)).to(dtype) * scale
    if causal:
        length_q, length_k = scores.shape[-2:]
        keep = torch.ones(length_q, length_k, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(dtype)
    return scores


def attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool, scale: float | None, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, lse)``: the output in the query's dtype, ``lse`` of shape ``(batch, heads, q_len)`` in float32
    (float64 for float64 inputs)."""
    scale = _scale(query, scale)
    if kernel and mask is None and attention_ops.kernel_refusal(query, key, value, causal) is None:
        return attention_ops.attention(query, key, value, None, -1, 0 if causal else -1, scale)
    scores = _masked_scores(query, key, mask, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    weights = probabilities(scores, lse).to(value.dtype)
    return torch.matmul(weights, expand_heads(query, value)).to(query.dtype), lse


def attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                       scale: float | None, kernel: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of query, key, value and (for an additive mask) the mask, from ``attention_forward``'s
    ``out`` and ``lse``."""
    scale = _scale(query, scale)
    heads = key.shape[-3]
    if kernel and mask is None and attention_ops.kernel_refusal(query, key, value, causal) is None:
        return (*attention_ops.attention_backward(grad_out, query, key, value, out, lse, None, -1,
                                                  0 if causal else -1, scale), None)
    dtype = _computation_dtype(query)
    weights = probabilities(_masked_scores(query, key, mask, causal, scale), lse.to(dtype))
    grad = grad_out.to(dtype)
    grad_value = torch.matmul(weights.transpose(-2, -1), grad)
    grad_probabilities = torch.matmul(grad, expand_heads(query, value).to(dtype).transpose(-2, -1))
    row = (grad * out.to(dtype)).sum(dim=-1, keepdim=True)
    grad_scores = weights * (grad_probabilities - row)
    grad_query = torch.matmul(grad_scores, expand_heads(query, key).to(dtype)) * scale
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query.to(dtype)) * scale
    grad_mask = None
    if mask is not None and mask.dtype != torch.bool:
        grad_mask = _sum_to(grad_scores, mask.shape).to(mask.dtype)
    return (grad_query.to(query.dtype), fold_heads(grad_key, heads).to(key.dtype),
            fold_heads(grad_value, heads).to(value.dtype), grad_mask)


def _sum_to(grad: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``grad`` summed over the dimensions a tensor of ``shape`` was broadcast along."""
    lead = grad.dim() - len(shape)
    dims = [*range(lead), *(lead + i for i, size in enumerate(shape) if size == 1 and grad.shape[lead + i] != 1)]
    return grad.sum(dims, keepdim=True).reshape(shape) if dims else grad


# --- the kernels' signatures -----------------------------------------------------------------------------


def flash_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None, kernel=False):
    if dropout_p:
        return NotImplemented
    return attention_forward(query, key, value, attn_mask, is_causal, scale, kernel)


def flash_for_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                           scale=None, kernel=False):
    if dropout_p:
        return NotImplemented
    return attention_backward(grad_out, query, key, value, out, logsumexp, attn_mask, is_causal, scale,
                              kernel)[:3]


def efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None,
              kernel=False):
    if dropout_p:
        return NotImplemented
    out, lse = attention_forward(query, key, value, attn_bias, is_causal, scale, kernel)
    if compute_log_sumexp:  # the kernel pads the rows to a multiple of 32
        length = query.shape[-2]
        lse = torch.nn.functional.pad(lse, (0, -length % 32))
    else:
        lse = lse.new_empty((*lse.shape[:-1], 0))
    return out, lse, _seed(query), _seed(query)


def efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                       dropout_p, grad_input_mask, is_causal=False, *, scale=None, kernel=False):
    if dropout_p:
        return NotImplemented
    lse = logsumexp[..., :query.shape[-2]]
    grads = attention_backward(grad_out, query, key, value, out, lse, attn_bias, is_causal, scale, kernel)
    return (*grads[:3], grads[3] if attn_bias is not None and grad_input_mask[3] else None)


def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None,
          kernel=False):
    return with_bias(query, key, value, None, True, dropout_p, is_causal, return_debug_mask, scale=scale,
                     kernel=kernel)


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, philox_seed, philox_offset, *, scale=None, kernel=False):
    if dropout_p:
        return NotImplemented
    return attention_backward(grad_out, query, key, value, out, logsumexp, None, is_causal, scale, kernel)[:3]


def with_bias(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
              return_debug_mask=False, *, scale=None, kernel=False):
    """The cuDNN kernel's forward (its bias is an additive mask); the flash kernel's, without a bias."""
    if dropout_p or return_debug_mask:
        return NotImplemented
    out, lse = attention_forward(query, key, value, attn_bias, is_causal, scale, kernel)
    empty = query.new_empty(0, dtype=torch.int32)
    return (out, lse, empty, empty, query.shape[-2], key.shape[-2], _seed(query), _seed(query),
            query.new_empty(0))


def cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                   cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None, kernel=False):
    if dropout_p:
        return NotImplemented
    return attention_backward(grad_out, query, key, value, out, logsumexp, attn_bias, is_causal, scale,
                              kernel)[:3]


def overrideable(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                 scale=None, kernel=False):
    return with_bias(query, key, value, attn_bias, True, dropout_p, is_causal, return_debug_mask, scale=scale,
                     kernel=kernel)


def overrideable_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                          cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None,
                          kernel=False):
    if dropout_p:
        return NotImplemented
    grads = attention_backward(grad_out, query, key, value, out, logsumexp, attn_bias, is_causal, scale, kernel)
    return (*grads[:3], grads[3] if attn_bias is not None and grad_input_mask[3] else None)


def _computation_dtype(query: torch.Tensor) -> torch.dtype:
    """What the kernels compute scores and the log-sum-exp in: float64 for float64, else float32."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _seed(query: torch.Tensor) -> torch.Tensor:
    """A stand-in for a kernel's random seed or offset: without dropout, nothing reads it."""
    return torch.zeros((), dtype=torch.int64, device=query.device)


FUSED_PAIRS: dict[str, tuple[Callable[..., Any], str, Callable[..., Any]]] = {
    "_scaled_dot_product_flash_attention_for_cpu": (flash_for_cpu, "_scaled_dot_product_flash_attention_for_cpu_"
                                                    "backward", flash_for_cpu_backward),
    "_scaled_dot_product_efficient_attention": (efficient, "_scaled_dot_product_efficient_attention_backward",
                                                efficient_backward),
    "_scaled_dot_product_flash_attention": (flash, "_scaled_dot_product_flash_attention_backward",
                                            flash_backward),
    "_scaled_dot_product_cudnn_attention": (with_bias, "_scaled_dot_product_cudnn_attention_backward",
                                            cudnn_backward),
    "_scaled_dot_product_fused_attention_overrideable": (
        overrideable, "_scaled_dot_product_fused_attention_overrideable_backward", overrideable_backward),
}
"""Each fused forward kernel: its decomposition, its backward op's name, and that op's decomposition."""


def fused_attention_decompositions(kernel: bool) -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """Decomposition entries for every fused attention kernel and its backward, where this PyTorch has them;
    with ``kernel``, calls the TPU kernel takes go to ``tpucompile::attention``."""
    table = {}
    for forward_name, (forward, backward_name, backward) in FUSED_PAIRS.items():
        for name, fn in ((forward_name, forward), (backward_name, backward)):
            packet = getattr(aten, name, None)
            if packet is not None and "default" in packet.overloads():
                table[packet.default] = functools.partial(fn, kernel=kernel) if kernel else fn
    return table
