"""Causal attention for the example models' references, in the form a JAX user writes for the target: the
splash kernel (``hf_decoder._splash_attention``) where the benchmark compiles for a TPU (``KERNEL``), the
math form (float32 scores and softmax, rounded once) where the references are checked against torch here."""

import math

import jax
import jax.numpy as jnp

from . import hf_decoder

KERNEL = False
"""Attention by the splash kernel (set by ``bench/tpu.py``; the tests run it in interpret mode)."""


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Grouped-query causal attention: ``q`` (batch, length, heads, head_dim), ``k``/``v`` (batch, length,
    kv_heads, head_dim); query head ``h`` reads key/value head ``h // (heads // kv_heads)``, as torch's
    ``enable_gqa`` does. Returns (batch, length, heads * head_dim)."""
    batch, length, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    if KERNEL:
        valid = jnp.ones((batch, length), jnp.int32)
        heads_first = [t.transpose(0, 2, 1, 3) for t in (q, k, v)]
        y = hf_decoder._splash_attention(*heads_first, valid, None).transpose(0, 2, 1, 3)
        return y.reshape(batch, length, n_heads * head_dim)
    q = q.reshape(batch, length, n_kv_heads, n_heads // n_kv_heads, head_dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)  # the diagonal is never masked, so no row is all -inf
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    y = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v)
    return y.reshape(batch, length, n_heads * head_dim)
