"""Hugging Face's Llama-family decoders (``LlamaForCausalLM``, ``MistralForCausalLM`` with its sliding window,
``Qwen3ForCausalLM`` with its query/key norms) written by hand in JAX as a JAX user writes them for a TPU:
attention is jax's Pallas splash-attention kernel (a causal or local mask, the padding mask as segment ids,
grouped-query heads by the kernel's multi-query form), differentiated through the kernel's own custom VJP.

``params`` is keyed like the torch model's ``dict(model.named_parameters())``. Inputs are ``(tokens,
attention_mask)`` and, for the loss, ``targets``: the cross-entropy over every position, as the benchmark's
torch loss computes it from the logits. The rotary embedding is transformers' (halves rotated), its tables
in float32 rounded to the parameters' dtype; RMSNorm works in float32 and rounds once.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

BLOCKS = (512, 256, 128)
INTERPRET = False
"""Run the kernel in Pallas' interpret mode (set by the tests, which run on a CPU)."""


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x @ weight.T


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' rotary embedding on ``x`` (batch, heads, length, head_dim)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_tables(config, length: int, dtype, theta: float | None = None) -> tuple[jax.Array, jax.Array]:
    """The cosines and sines of transformers' default rotary embedding, at base ``theta`` (the config's
    ``rope_theta`` unless given: Gemma 3 has one base per layer type)."""
    head_dim = _head_dim(config)
    theta = config.rope_parameters["rope_theta"] if theta is None else theta
    frequencies = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(length, dtype=jnp.float32), frequencies)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, window: int | None,
                      scale: float | None = None) -> jax.Array:
    """Causal grouped-query attention by the splash kernel, over the last ``window`` keys if given; ``q``
    (batch, heads, length, head_dim), ``k``/``v`` (batch, kv_heads, length, head_dim), ``valid`` (batch,
    length) the padding mask; the scores are scaled by ``scale`` (1 / sqrt(head_dim) unless given)."""
    batch, heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    block = next(b for b in BLOCKS if length % b == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    if window is not None and window < length:
        one = splash.LocalMask((length, length), (window - 1, 0), offset=0)
    else:
        one = splash.CausalMask((length, length))
    mask = splash.MultiHeadMask([one] * (heads // kv_heads))
    kernel = splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=INTERPRET)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    grouped = (q * scale).astype(q.dtype).reshape(batch, kv_heads, heads // kv_heads, length, head_dim)
    segments = splash.SegmentIds(q=jnp.ones_like(valid, jnp.int32), kv=valid.astype(jnp.int32))

    def one_head(q, k, v, segment_ids):
        return kernel(q, k, v, segment_ids=segment_ids)

    per_batch = jax.vmap(one_head, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_batch, in_axes=(0, 0, 0, 0))(grouped, k, v, segments)
    return out.reshape(batch, heads, length, head_dim)


def _logits(params: dict[str, jax.Array], tokens: jax.Array, valid: jax.Array, config) -> jax.Array:
    batch, length = tokens.shape
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = _head_dim(config)
    window = getattr(config, "sliding_window", None)
    x = params["model.embed_tokens.weight"][tokens]
    cos, sin = _rope_tables(config, length, x.dtype)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        h = _rms_norm(x, params[f"{prefix}.input_layernorm.weight"], config.rms_norm_eps)

        def project(name, count, h=h, prefix=prefix):
            y = _linear(h, params[f"{prefix}.self_attn.{name}.weight"]).reshape(batch, length, count, head_dim)
            return y.transpose(0, 2, 1, 3)

        q, k, v = project("q_proj", heads), project("k_proj", kv_heads), project("v_proj", kv_heads)
        if f"{prefix}.self_attn.q_norm.weight" in params:  # Qwen3: RMSNorm over each head
            q = _rms_norm(q, params[f"{prefix}.self_attn.q_norm.weight"], config.rms_norm_eps)
            k = _rms_norm(k, params[f"{prefix}.self_attn.k_norm.weight"], config.rms_norm_eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        attended = _splash_attention(q, k, v, valid, window).transpose(0, 2, 1, 3).reshape(batch, length, -1)
        x = x + _linear(attended, params[f"{prefix}.self_attn.o_proj.weight"])
        h = _rms_norm(x, params[f"{prefix}.post_attention_layernorm.weight"], config.rms_norm_eps)
        gate = jax.nn.silu(_linear(h, params[f"{prefix}.mlp.gate_proj.weight"]))
        x = x + _linear(gate * _linear(h, params[f"{prefix}.mlp.up_proj.weight"]),
                        params[f"{prefix}.mlp.down_proj.weight"])
    x = _rms_norm(x, params["model.norm.weight"], config.rms_norm_eps)
    return _linear(x, params["lm_head.weight"])


def entry_points(logits: Callable[..., jax.Array]) -> tuple[Callable[..., jax.Array], Callable[..., jax.Array]]:
    """A reference's ``forward(params, (tokens, attention_mask), config)`` and ``loss(params, (tokens,
    attention_mask, targets), config)`` around its ``logits(params, tokens, attention_mask, config)``."""

    def forward(params: dict[str, jax.Array], inputs: tuple, config) -> jax.Array:
        tokens, valid = inputs
        return logits(params, tokens, valid, config)

    def loss(params: dict[str, jax.Array], inputs: tuple, config) -> jax.Array:
        tokens, valid, targets = inputs
        return cross_entropy(logits(params, tokens, valid, config), targets)

    return forward, loss


forward, loss = entry_points(_logits)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The mean cross-entropy over every position, in float32 (as the benchmark's torch loss)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()
