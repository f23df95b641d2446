"""Attention as one op through autograd: ``tpucompile::attention`` and its backward.

Where a memory-efficient attention kernel is wanted (a TPU target: ``frontend.attention``), attention must
reach the lowering whole, forward and backward, instead of as the matmul/softmax/matmul that autograd would
differentiate: the kernel never writes the scores to memory, and its backward recomputes them from the
row log-sum-exp the forward returns. These custom ops keep it whole through AOTAutograd; their lowering
(``lowering/rules/attention.py``) picks the kernel per platform.

Layout is PyTorch's: ``(batch, heads, length, head_dim)``, the same number of heads in query, key and value
(grouped-query attention repeats key and value heads before the call). ``lse`` is the log-sum-exp of each
query row of the scaled (and causally masked) scores, in float32. The eager implementations compute the math
form in float32, as the lowering does on platforms without the kernel.
"""

from __future__ import annotations

import torch

__all__ = ["KERNEL_BLOCK", "attention", "attention_backward", "kernel_refusal"]

KERNEL_BLOCK = 128
"""The kernel's tile along the sequence and head dims: lengths and head sizes must be multiples of it."""


def kernel_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool) -> str | None:
    """None when the TPU kernel takes attention of these (possibly fake) tensors, else why not. Key and value
    may have fewer heads than the query (grouped-query attention, repeated before the call)."""
    values = (query, key, value)
    if any(t.dim() != 4 for t in values) or query.dtype != key.dtype or key.dtype != value.dtype:
        return "it is not 4-d attention with one dtype"
    if query.dtype not in (torch.float32, torch.bfloat16):
        return f"{query.dtype} is not float32 or bfloat16"
    if any(isinstance(s, torch.SymInt) for t in values for s in t.shape):
        return "its sizes are symbolic"
    if key.shape[-3] != value.shape[-3] or query.shape[-3] % key.shape[-3]:
        return "its key and value heads do not divide its query heads"
    if query.shape[-1] != key.shape[-1] or key.shape[-1] != value.shape[-1] or query.shape[-1] % KERNEL_BLOCK:
        return f"its head size is not one multiple of {KERNEL_BLOCK}"
    if query.shape[-2] % KERNEL_BLOCK or key.shape[-2] % KERNEL_BLOCK:
        return f"its lengths are not multiples of {KERNEL_BLOCK}"
    if causal and query.shape[-2] != key.shape[-2]:
        return "it is causal with unequal lengths"
    return None


def _scores(query: torch.Tensor, key: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(query.float(), key.float().transpose(-2, -1)) * scale
    if causal:
        length_q, length_k = scores.shape[-2:]
        above = torch.ones(length_q, length_k, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


@torch.library.custom_op("tpucompile::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(scale * q k^T, causally masked) v, logsumexp of each scaled score row)``."""
    scores = _scores(query, key, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), value.float())
    return out.to(query.dtype), lse


@attention.register_fake
def _attention_fake(query, key, value, causal, scale):
    return query.new_empty(query.shape), query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("tpucompile::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value, with the probabilities recomputed from ``lse``."""
    probabilities = torch.exp(_scores(query, key, causal, scale) - lse[..., None])
    grad = grad_out.float()
    grad_value = torch.matmul(probabilities.transpose(-2, -1), grad)
    grad_probabilities = torch.matmul(grad, value.float().transpose(-2, -1))
    row = (grad * out.float()).sum(dim=-1, keepdim=True)
    grad_scores = probabilities * (grad_probabilities - row) * scale
    grad_query = torch.matmul(grad_scores, key.float())
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query.float())
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


@attention_backward.register_fake
def _attention_backward_fake(grad_out, query, key, value, out, lse, causal, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse = ctx.saved_tensors
    grad_query, grad_key, grad_value = attention_backward(grad_out, query, key, value, out, lse, ctx.causal,
                                                          ctx.scale)
    return grad_query, grad_key, grad_value, None, None


attention.register_autograd(_backward, setup_context=_setup_context)
