"""``tpucompile::attention`` and its backward (``attention_ops``): a flash-attention kernel on TPUs, the math
form elsewhere, both lowered through jax (``jax_bridge``), so a program holding them is lowered again for
each platform it is compiled for.

On a TPU the forward is jax's Pallas flash-attention kernel with its residuals (the row maximum ``m`` and
sum ``l`` of the exponentials, folded into the op's ``lse = m + log l``); the backward is the same kernel
family's two backward passes (keys/values, then queries), which recompute the probabilities as
``exp(s - m) / l``: given ``m = lse`` and ``l = 1`` they read exactly the forward's. Those passes are private
to jax; where a jax version lacks them the backward recomputes the forward through the public kernel's
``jax.vjp`` instead (more flops, same values). Elsewhere both ops are the math form in float32.
"""

from __future__ import annotations

import functools

import torch

from tpucompile import attention_ops  # noqa: F401  (registers the ops)
from tpucompile.lowering import jax_bridge
from tpucompile.lowering.registry import register_lowering

_BLOCK = 128
_MASK_VALUE = -0.7 * float(torch.finfo(torch.float32).max)


@register_lowering(torch.ops.tpucompile.attention.default)
def _attention(ctx, query, key, value, causal, scale):
    kernel = jax_bridge.current_platform() == "tpu"
    fn = functools.partial(flash_forward if kernel else math_forward, causal=causal, scale=scale)
    name = "attention_flash" if kernel else "attention_math"
    return tuple(jax_bridge.call(name, fn, [query, key, value], list(ctx.avals_out), params=(causal, scale),
                                 x64=not kernel))


@register_lowering(torch.ops.tpucompile.attention_backward.default)
def _attention_backward(ctx, grad_out, query, key, value, out, lse, causal, scale):
    kernel = jax_bridge.current_platform() == "tpu"
    fn = functools.partial(flash_backward if kernel else math_backward, causal=causal, scale=scale)
    name = "attention_backward_flash" if kernel else "attention_backward_math"
    return tuple(jax_bridge.call(name, fn, [grad_out, query, key, value, out, lse], list(ctx.avals_out),
                                 params=(causal, scale), x64=not kernel))


def _scores(query, key, causal: bool, scale: float):
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", query, key, preferred_element_type=jnp.float32) * scale
    if causal:
        length_q, length_k = scores.shape[-2:]
        keep = jnp.arange(length_k)[None, :] <= jnp.arange(length_q)[:, None]
        scores = jnp.where(keep, scores, -jnp.inf)
    return scores


def math_forward(query, key, value, *, causal: bool, scale: float):
    """``(out, lse)`` of attention, the math form in float32 (matmuls accumulate in float32)."""
    import jax
    import jax.numpy as jnp

    scores = _scores(query, key, causal, scale)
    lse = jax.nn.logsumexp(scores, axis=-1)
    probabilities = jnp.exp(scores - lse[..., None])
    out = jnp.einsum("bhqk,bhkd->bhqd", probabilities, value.astype(jnp.float32))
    return out.astype(query.dtype), lse


def math_backward(grad_out, query, key, value, out, lse, *, causal: bool, scale: float):
    """Gradients of query, key and value, the probabilities recomputed from ``lse``."""
    import jax.numpy as jnp

    probabilities = jnp.exp(_scores(query, key, causal, scale) - lse[..., None])
    grad = grad_out.astype(jnp.float32)
    grad_value = jnp.einsum("bhqk,bhqd->bhkd", probabilities, grad)
    grad_probabilities = jnp.einsum("bhqd,bhkd->bhqk", grad, value.astype(jnp.float32))
    row = jnp.sum(grad * out.astype(jnp.float32), axis=-1, keepdims=True)
    grad_scores = probabilities * (grad_probabilities - row) * scale
    grad_query = jnp.einsum("bhqk,bhkd->bhqd", grad_scores, key.astype(jnp.float32))
    grad_key = jnp.einsum("bhqk,bhqd->bhkd", grad_scores, query.astype(jnp.float32))
    return grad_query.astype(query.dtype), grad_key.astype(key.dtype), grad_value.astype(value.dtype)


def _kernels():
    from jax.experimental.pallas.ops.tpu import flash_attention

    return flash_attention


def flash_forward(query, key, value, *, causal: bool, scale: float):
    """``(out, lse)`` by jax's Pallas TPU flash-attention kernel."""
    import jax.numpy as jnp

    kernels = _kernels()
    out, total, maximum = kernels._flash_attention_impl(
        query, key, value, None, None, True, causal, scale, 1, _BLOCK, _BLOCK, _BLOCK, False)
    return out, maximum + jnp.log(total)


def flash_backward(grad_out, query, key, value, out, lse, *, causal: bool, scale: float):
    """Gradients of query, key and value by the Pallas kernel's backward passes (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    kernels = _kernels()
    if not hasattr(kernels, "_flash_attention_bwd_dkv") or not hasattr(kernels, "_flash_attention_bwd_dq"):
        def forward(q, k, v):
            return kernels.flash_attention(q, k, v, causal=causal, sm_scale=scale)

        return jax.vjp(forward, query, key, value)[1](grad_out)
    row = jnp.sum(out.astype(jnp.float32) * grad_out.astype(jnp.float32), axis=-1)
    ones = jnp.ones_like(lse)
    grad_key, grad_value = kernels._flash_attention_bwd_dkv(
        query, key, value, None, None, ones, lse, grad_out, row, block_q_major=_BLOCK, block_k_major=_BLOCK,
        block_k=_BLOCK, block_q=_BLOCK, sm_scale=scale, causal=causal, mask_value=_MASK_VALUE, debug=False)
    grad_query, _ = kernels._flash_attention_bwd_dq(
        query, key, value, None, None, ones, lse, grad_out, row, block_q_major=_BLOCK, block_k_major=_BLOCK,
        block_k=_BLOCK, sm_scale=scale, causal=causal, mask_value=_MASK_VALUE, debug=False)
    return grad_query.astype(query.dtype), grad_key.astype(key.dtype), grad_value.astype(value.dtype)
