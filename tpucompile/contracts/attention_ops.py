"""Attention as one op through autograd: ``tpucompile::attention`` and its backward.

Where a memory-efficient attention kernel is wanted (a TPU target: ``frontend.attention``), attention must
reach the lowering whole, forward and backward, instead of as the matmul/softmax/matmul that autograd would
differentiate: the kernel never writes the scores to memory, and its backward recomputes them from the
row log-sum-exp the forward returns. These custom ops keep it whole through AOTAutograd; their lowering
(``lowering/rules/attention.py``) picks the kernel per platform.

Layout is PyTorch's: ``(batch, heads, length, head_dim)``. Key and value may have fewer heads than the query
(grouped-query attention): query head ``h`` reads key/value head ``h // (heads / kv_heads)``, as
``repeat_kv`` and ``enable_gqa`` arrange it, and the kernel reads each key/value head once.

The mask is a description, never a tensor of scores' shape: query ``i`` sees key ``j`` where
``i - j <= left`` (unless ``left < 0``), ``j - i <= right`` (unless ``right < 0``) and, given
``kv_valid`` (boolean, ``(batch, kv_len)``), ``kv_valid[b, j]``. So ``right = 0`` is causal attention,
``left = w - 1, right = 0`` a causal sliding window of ``w`` keys, and ``kv_valid`` a padding mask. A query
row that sees no key gets zeros (PyTorch's attention gives zeros there too) and an ``lse`` of -inf.

``lse`` is the log-sum-exp of each query row of the scaled, masked scores, in float32. The eager
implementations compute the math form in float32, as the lowering does on platforms without the kernel.
"""

from __future__ import annotations

import torch

__all__ = ["KERNEL_BLOCK", "attention", "attention_backward", "attention_with_grad", "expand_heads", "fold_heads",
           "keep_mask", "kernel_refusal", "probabilities"]

KERNEL_BLOCK = 128
"""The kernel's tile along the sequence: lengths must be multiples of it."""

HEAD_SIZES = range(32, 257, 16)
"""Head sizes the kernel is compiled for (one tile holds a whole head)."""


def kernel_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, banded: bool) -> str | None:
    """None when the TPU kernel takes attention of these (possibly fake) tensors, else why not. Key and value
    may have fewer heads than the query (grouped-query attention); ``banded``: the mask bounds ``j - i`` or
    ``i - j`` (causal or a window), which the kernel aligns top-left on equal lengths only."""
    values = (query, key, value)
    if any(t.dim() != 4 for t in values) or query.dtype != key.dtype or key.dtype != value.dtype:
        return "it is not 4-d attention with one dtype"
    if query.dtype not in (torch.float32, torch.bfloat16):
        return f"{query.dtype} is not float32 or bfloat16"
    if any(isinstance(s, torch.SymInt) for t in values for s in t.shape):
        return "its sizes are symbolic"
    if key.shape[-3] != value.shape[-3] or query.shape[-3] % key.shape[-3]:
        return "its key and value heads do not divide its query heads"
    if query.shape[-1] != key.shape[-1] or key.shape[-1] != value.shape[-1]:
        return "its query, key and value head sizes differ"
    if query.shape[-1] not in HEAD_SIZES:
        return f"its head size {query.shape[-1]} is not a multiple of 16 from 32 to 256"
    if query.shape[-2] % KERNEL_BLOCK or key.shape[-2] % KERNEL_BLOCK:
        return f"its lengths are not multiples of {KERNEL_BLOCK}"
    if banded and query.shape[-2] != key.shape[-2]:
        return "it is causal or windowed with unequal lengths"
    return None


def keep_mask(length_q: int, length_k: int, kv_valid: torch.Tensor | None, left: int, right: int,
              device: torch.device) -> torch.Tensor | None:
    """The boolean mask the description stands for, ``(length_q, length_k)`` or ``(batch, 1, length_q,
    length_k)`` with ``kv_valid``; None when every key is seen."""
    offset = torch.arange(length_k, device=device)[None, :] - torch.arange(length_q, device=device)[:, None]
    keep = None
    if left >= 0:
        keep = offset >= -left
    if right >= 0:
        keep = offset <= right if keep is None else keep & (offset <= right)
    if kv_valid is not None:
        valid = kv_valid[:, None, None, :].to(torch.bool)
        keep = valid if keep is None else keep & valid
    return keep


def expand_heads(query: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Key or value heads repeated to the query's (grouped-query attention); as it is otherwise."""
    groups = query.shape[-3] // tensor.shape[-3]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=-3)


def fold_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of ``expand_heads``: each group of query heads summed into its key or value head."""
    if grad.shape[-3] == heads:
        return grad
    return grad.unflatten(-3, (heads, grad.shape[-3] // heads)).sum(-3)


def _scores(query, key, kv_valid, left: int, right: int, scale: float) -> torch.Tensor:
    scores = torch.matmul(query.float(), expand_heads(query, key).float().transpose(-2, -1)) * scale
    keep = keep_mask(scores.shape[-2], scores.shape[-1], kv_valid, left, right, scores.device)
    return scores if keep is None else scores.masked_fill(~keep, float("-inf"))


def probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)``, 0 on rows that see no key (``lse`` -inf)."""
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite[..., None])


@torch.library.custom_op("tpucompile::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_valid: torch.Tensor | None,
              left: int, right: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(scale * q k^T, masked) v, logsumexp of each scaled, masked score row)``."""
    scores = _scores(query, key, kv_valid, left, right, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(probabilities(scores, lse), expand_heads(query, value).float())
    return out.to(query.dtype), lse


@attention.register_fake
def _attention_fake(query, key, value, kv_valid, left, right, scale):
    return query.new_empty(query.shape), query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("tpucompile::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, kv_valid: torch.Tensor | None, left: int,
                       right: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of query, key and value, with the probabilities recomputed from ``lse``."""
    weights = probabilities(_scores(query, key, kv_valid, left, right, scale), lse)
    grad = grad_out.float()
    grad_value = torch.matmul(weights.transpose(-2, -1), grad)
    grad_probabilities = torch.matmul(grad, expand_heads(query, value).float().transpose(-2, -1))
    row = (grad * out.float()).sum(dim=-1, keepdim=True)
    grad_scores = weights * (grad_probabilities - row) * scale
    grad_query = torch.matmul(grad_scores, expand_heads(query, key).float())
    grad_key = torch.matmul(grad_scores.transpose(-2, -1), query.float())
    heads = key.shape[-3]
    return (grad_query.to(query.dtype), fold_heads(grad_key, heads).to(key.dtype),
            fold_heads(grad_value, heads).to(value.dtype))


@attention_backward.register_fake
def _attention_backward_fake(grad_out, query, key, value, out, lse, kv_valid, left, right, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


class _Attention(torch.autograd.Function):
    """``attention`` differentiable by autograd and by ``torch.func`` transforms alike (a custom op's own
    autograd formula is not supported inside ``torch.func.grad``; an ``autograd.Function`` with
    ``setup_context`` is, and runs the op on the transform's unwrapped tensors)."""

    @staticmethod
    def forward(query, key, value, kv_valid, left, right, scale):
        return attention(query, key, value, kv_valid, left, right, scale)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        query, key, value, kv_valid, left, right, scale = inputs
        out, lse = output
        ctx.save_for_backward(query, key, value, out, lse, kv_valid)
        ctx.left, ctx.right, ctx.scale = left, right, scale
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse, kv_valid = ctx.saved_tensors
        grads = _AttentionBackward.apply(grad_out, query, key, value, out, lse, kv_valid, ctx.left, ctx.right,
                                         ctx.scale)
        return (*grads, None, None, None, None)


class _AttentionBackward(torch.autograd.Function):
    """``attention_backward`` called from ``_Attention.backward``, which ``torch.func`` runs on wrapped
    tensors: as a function of its own it runs the op on unwrapped ones. Not differentiable again."""

    @staticmethod
    def forward(grad_out, query, key, value, out, lse, kv_valid, left, right, scale):
        return attention_backward(grad_out, query, key, value, out, lse, kv_valid, left, right, scale)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("tpucompile::attention_backward has no derivative: attention through the kernel is "
                           "differentiable once (use attention='math' for higher derivatives)")


def attention_with_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_valid: torch.Tensor | None,
                        left: int, right: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention`` as autograd and ``torch.func`` transforms differentiate it (its backward is
    ``attention_backward``)."""
    return _Attention.apply(query, key, value, kv_valid, left, right, scale)
