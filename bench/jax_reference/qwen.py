"""examples/qwen.py's Qwen-style mixture-of-experts decoder written by hand in plain JAX: the benchmark's
reference for what XLA's cost analysis of the same model looks like without tpucompile.

``params`` is keyed like the torch model's ``dict(model.named_parameters())``; the output head is tied to the
token embedding and reads ``embed_tokens.weight``. The rotary tables are recomputed here from the config, in
float32 and then rounded to the parameters' dtype (as ``model.to(dtype)`` rounds torch's
``rope_cos``/``rope_sin`` buffers), so the buffers need not be in ``params`` and are ignored if they are.

The mixture of experts routes as the torch model does: softmax over the router's logits, the top-k
probabilities renormalised to sum to one, every expert run on every token and weighted by its (dense, mostly
zero) combine weight, and the Switch-Transformer balance loss, scaled by ``router_aux_loss_coef``, added to the
cross-entropy.

Deliberate differences from torch, all in how low-precision (bfloat16) parameters are computed with: RMSNorm's
statistics and normalisation and the router and attention softmaxes work in float32 and round to the
parameters' dtype once (torch's RMSNorm rounds after each op), and the loss comes back as a float32 scalar.
The top-k is ``jax.lax.top_k``, which breaks ties toward the lower expert index; ``torch.topk`` promises no order
(on CPU it took the higher index). Ties only matter in bfloat16, where router probabilities near 1/n_experts tie
exactly for a few tokens a layer, and those tokens then take another expert than in torch.
"""

from typing import Protocol

import jax
import jax.numpy as jnp

from . import attention


class QwenConfigLike(Protocol):
    """The fields of examples/qwen.py's ``QwenConfig`` that the model reads."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_hidden_dim: int
    max_seq_len: int
    rope_theta: float
    norm_eps: float
    router_aux_loss_coef: float


def _linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``torch.nn.Linear`` without bias: ``weight`` is (out_features, in_features)."""
    return x @ weight.T


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * x / rms(x) over the last axis, the normalisation in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def _rope_tables(head_dim: int, length: int, theta: float, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin of position * frequency for positions 0..length-1, shape (length, head_dim): the
    head_dim // 2 frequencies, twice over (for the rotate-half form)."""
    frequencies = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(length, dtype=jnp.float32), frequencies)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rotate_half(x: jax.Array) -> jax.Array:
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-second, first], axis=-1)


def _apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding of ``x`` (batch, length, heads, head_dim); ``cos``/``sin`` are (length, head_dim)."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # the same for every head
    return x * cos + _rotate_half(x) * sin


def _attention(params: dict[str, jax.Array], prefix: str, x: jax.Array, cos: jax.Array, sin: jax.Array,
               config: QwenConfigLike) -> jax.Array:
    batch, length, _ = x.shape
    heads = (batch, length, config.n_heads, config.head_dim)
    kv_heads = (batch, length, config.n_kv_heads, config.head_dim)
    q = _linear(x, params[f"{prefix}.q_proj.weight"]).reshape(heads)
    k = _linear(x, params[f"{prefix}.k_proj.weight"]).reshape(kv_heads)
    v = _linear(x, params[f"{prefix}.v_proj.weight"]).reshape(kv_heads)
    q = _rms_norm(q, params[f"{prefix}.q_norm.weight"], config.norm_eps)  # per head, shared across heads
    k = _rms_norm(k, params[f"{prefix}.k_norm.weight"], config.norm_eps)
    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    return _linear(attention.causal_attention(q, k, v), params[f"{prefix}.o_proj.weight"])


def _expert(params: dict[str, jax.Array], prefix: str, x: jax.Array) -> jax.Array:
    """A SwiGLU MLP: down(silu(gate x) * up x)."""
    gate = jax.nn.silu(_linear(x, params[f"{prefix}.gate_proj.weight"]))
    return _linear(gate * _linear(x, params[f"{prefix}.up_proj.weight"]), params[f"{prefix}.down_proj.weight"])


def _moe(params: dict[str, jax.Array], prefix: str, x: jax.Array,
         config: QwenConfigLike) -> tuple[jax.Array, jax.Array]:
    """The mixture-of-experts layer's output and its load-balancing loss (a float32 scalar)."""
    tokens = x.reshape(-1, x.shape[-1])  # (n, dim)
    router_logits = _linear(tokens, params[f"{prefix}.router.weight"])
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1).astype(x.dtype)  # (n, experts)
    top_weights, top_experts = jax.lax.top_k(probs, config.top_k)  # (n, k)
    top_weights = top_weights / top_weights.sum(-1, keepdims=True)
    # Dense combine weights: token i's weight for expert e, zero where e is not among its top k.
    chosen = jax.nn.one_hot(top_experts, config.n_experts, dtype=probs.dtype)  # (n, k, experts)
    combine = (chosen * top_weights[..., None]).sum(1)
    out = jnp.zeros_like(tokens)
    for index in range(config.n_experts):
        out = out + combine[:, index : index + 1] * _expert(params, f"{prefix}.experts.{index}", tokens)
    # Switch-Transformer balance loss: experts * sum_e (fraction of tokens routed to e) * (mean prob of e).
    routed = (combine > 0).astype(jnp.float32).mean(0) / config.top_k
    balance = config.n_experts * jnp.sum(routed * probs.astype(jnp.float32).mean(0))
    return out.reshape(x.shape), balance


def _logits_and_balance(params: dict[str, jax.Array], tokens: jax.Array,
                        config: QwenConfigLike) -> tuple[jax.Array, jax.Array]:
    """The logits (batch, length, vocab_size) and the layers' summed balance loss."""
    length = tokens.shape[1]
    if length > config.max_seq_len:
        raise ValueError(f"{length} tokens, but the model's rotary tables cover {config.max_seq_len}")
    x = params["embed_tokens.weight"][tokens]
    cos, sin = _rope_tables(config.head_dim, length, config.rope_theta, x.dtype)
    balance = jnp.zeros((), jnp.float32)
    for layer in range(config.n_layers):
        prefix = f"layers.{layer}"
        h = _rms_norm(x, params[f"{prefix}.input_layernorm.weight"], config.norm_eps)
        x = x + _attention(params, f"{prefix}.self_attn", h, cos, sin, config)
        h = _rms_norm(x, params[f"{prefix}.post_attention_layernorm.weight"], config.norm_eps)
        y, layer_balance = _moe(params, f"{prefix}.mlp", h, config)
        x, balance = x + y, balance + layer_balance
    x = _rms_norm(x, params["norm.weight"], config.norm_eps)
    return _linear(x, params["embed_tokens.weight"]), balance  # tied output head


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of ``targets`` over every position, in float32."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()


def forward(params: dict[str, jax.Array], inputs: tuple, config: QwenConfigLike) -> jax.Array:
    """Logits (batch, length, vocab_size) for ``inputs = (tokens,)``, as ``Qwen(config)(tokens)``."""
    (tokens,) = inputs
    logits, _ = _logits_and_balance(params, tokens, config)
    return logits


def loss(params: dict[str, jax.Array], inputs: tuple, config: QwenConfigLike) -> jax.Array:
    """The training loss for ``inputs = (tokens, targets)``, as ``Qwen(config)(tokens, targets)``: cross-entropy
    plus ``router_aux_loss_coef`` times the balance loss summed over the layers."""
    tokens, targets = inputs
    logits, balance = _logits_and_balance(params, tokens, config)
    return _cross_entropy(logits, targets) + config.router_aux_loss_coef * balance
