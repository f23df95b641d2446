"""examples/llama.py's LLaMA-style decoder written by hand in plain JAX: the benchmark's reference for what
XLA's cost analysis of the same model looks like without tpucompile.

``params`` is keyed like the torch model's ``dict(model.named_parameters())``; with ``tie_embeddings`` the
output head reads ``tok_embeddings.weight`` (torch lists the tied weight once, under that name). The rotary
tables are recomputed here from the config, in float32 and then rounded to the parameters' dtype (as
``model.to(dtype)`` rounds torch's ``rope_cos``/``rope_sin`` buffers), so the buffers need not be in
``params`` and are ignored if they are. Only the workload's calls are covered: the whole sequence at positions
0..length-1, without the KV cache.

Deliberate differences from torch, all in how low-precision (bfloat16) parameters are computed with: RMSNorm's
statistics and normalisation, the attention softmax and the cross-entropy work in float32 and round to the
parameters' dtype once (torch's RMSNorm rounds after each op), and the loss comes back as a float32 scalar
(torch's is in the parameters' dtype).
"""

from typing import Protocol

import jax
import jax.numpy as jnp

from . import attention


class LlamaConfigLike(Protocol):
    """The fields of examples/llama.py's ``LlamaConfig`` that the model reads."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``torch.nn.Linear`` without bias: ``weight`` is (out_features, in_features)."""
    return x @ weight.T


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * weight over the last axis, the normalisation in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


def _rope_tables(head_dim: int, length: int, theta: float, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin of position * frequency for positions 0..length-1, shape (length, head_dim // 2)."""
    frequencies = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(length, dtype=jnp.float32), frequencies)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of each head of ``x`` (batch, length, heads, head_dim)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # (length, 1, head_dim // 2): the same for every head
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape)


def _attention(params: dict[str, jax.Array], prefix: str, x: jax.Array, cos: jax.Array, sin: jax.Array,
               config: LlamaConfigLike) -> jax.Array:
    batch, length, _ = x.shape
    head_dim = config.dim // config.n_heads
    q = _linear(x, params[f"{prefix}.wq.weight"]).reshape(batch, length, config.n_heads, head_dim)
    k = _linear(x, params[f"{prefix}.wk.weight"]).reshape(batch, length, config.n_kv_heads, head_dim)
    v = _linear(x, params[f"{prefix}.wv.weight"]).reshape(batch, length, config.n_kv_heads, head_dim)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    return _linear(attention.causal_attention(q, k, v), params[f"{prefix}.wo.weight"])


def _feed_forward(params: dict[str, jax.Array], prefix: str, x: jax.Array) -> jax.Array:
    """SwiGLU: w2(silu(w1 x) * w3 x)."""
    gate = jax.nn.silu(_linear(x, params[f"{prefix}.w1.weight"]))
    return _linear(gate * _linear(x, params[f"{prefix}.w3.weight"]), params[f"{prefix}.w2.weight"])


def _logits(params: dict[str, jax.Array], tokens: jax.Array, config: LlamaConfigLike) -> jax.Array:
    length = tokens.shape[1]
    if length > config.max_seq_len:
        raise ValueError(f"{length} tokens, but the model's rotary tables cover {config.max_seq_len}")
    x = params["tok_embeddings.weight"][tokens]
    cos, sin = _rope_tables(config.dim // config.n_heads, length, config.rope_theta, x.dtype)
    for layer in range(config.n_layers):
        prefix = f"layers.{layer}"
        h = _rms_norm(x, params[f"{prefix}.attention_norm.weight"], config.norm_eps)
        x = x + _attention(params, f"{prefix}.attention", h, cos, sin, config)
        h = _rms_norm(x, params[f"{prefix}.ffn_norm.weight"], config.norm_eps)
        x = x + _feed_forward(params, f"{prefix}.feed_forward", h)
    x = _rms_norm(x, params["norm.weight"], config.norm_eps)
    head = params["tok_embeddings.weight"] if config.tie_embeddings else params["output.weight"]
    return _linear(x, head)


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of ``targets`` over every position, in float32."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()


def forward(params: dict[str, jax.Array], inputs: tuple, config: LlamaConfigLike) -> jax.Array:
    """Logits (batch, length, vocab_size) for ``inputs = (tokens,)``, as ``Llama(config)(tokens)``."""
    (tokens,) = inputs
    return _logits(params, tokens, config)


def loss(params: dict[str, jax.Array], inputs: tuple, config: LlamaConfigLike) -> jax.Array:
    """The training loss for ``inputs = (tokens, targets)``, as ``Llama(config)(tokens, targets=targets)``:
    cross-entropy."""
    tokens, targets = inputs
    return _cross_entropy(_logits(params, tokens, config), targets)
