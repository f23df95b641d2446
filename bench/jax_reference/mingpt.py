"""examples/mingpt.py's GPT written by hand in plain JAX: the benchmark's reference for what XLA's cost analysis
of the same model looks like without tpucompile.

``params`` is keyed like the torch model's ``dict(model.named_parameters())``. The output head is tied to the
token embedding, so it reads ``wte.weight`` (torch lists the tied weight once, under that name).

Deliberate differences from torch, all in how low-precision (bfloat16) parameters are computed with: the layer
norms, the attention softmax and the cross-entropy work in float32 and round their result to the parameters'
dtype once (torch does much the same inside its kernels), and the loss comes back as a float32 scalar (torch's
is in the parameters' dtype).
"""

from typing import Protocol

import jax
import jax.numpy as jnp

from . import attention


class GPTConfigLike(Protocol):
    """The fields of examples/mingpt.py's ``GPTConfig`` that the model reads."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


def _linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``torch.nn.Linear``: ``weight`` is (out_features, in_features)."""
    y = x @ weight.T
    return y if bias is None else y + bias


def _layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """``torch.nn.LayerNorm`` over the last axis: statistics and the affine map in float32."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    variance = jnp.square(x32 - mean).mean(-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(variance + eps)
    return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _attention(params: dict[str, jax.Array], prefix: str, x: jax.Array, n_head: int) -> jax.Array:
    batch, length, width = x.shape
    qkv = _linear(x, params[f"{prefix}.qkv.weight"], params[f"{prefix}.qkv.bias"])
    q, k, v = (t.reshape(batch, length, n_head, width // n_head) for t in jnp.split(qkv, 3, axis=-1))
    y = attention.causal_attention(q, k, v)
    return _linear(y, params[f"{prefix}.proj.weight"], params[f"{prefix}.proj.bias"])


def _mlp(params: dict[str, jax.Array], prefix: str, x: jax.Array) -> jax.Array:
    h = _linear(x, params[f"{prefix}.0.weight"], params[f"{prefix}.0.bias"])
    h = jax.nn.gelu(h, approximate=True)  # nn.GELU(approximate="tanh")
    return _linear(h, params[f"{prefix}.2.weight"], params[f"{prefix}.2.bias"])


def _block(params: dict[str, jax.Array], prefix: str, x: jax.Array, config: GPTConfigLike) -> jax.Array:
    ln_1 = _layer_norm(x, params[f"{prefix}.ln_1.weight"], params[f"{prefix}.ln_1.bias"])
    x = x + _attention(params, f"{prefix}.attn", ln_1, config.n_head)
    ln_2 = _layer_norm(x, params[f"{prefix}.ln_2.weight"], params[f"{prefix}.ln_2.bias"])
    return x + _mlp(params, f"{prefix}.mlp", ln_2)


def _logits(params: dict[str, jax.Array], idx: jax.Array, config: GPTConfigLike) -> jax.Array:
    length = idx.shape[1]
    x = params["wte.weight"][idx] + params["wpe.weight"][:length]
    for layer in range(config.n_layer):
        x = _block(params, f"blocks.{layer}", x, config)
    x = _layer_norm(x, params["ln_f.weight"], params["ln_f.bias"])
    return _linear(x, params["wte.weight"])  # lm_head, tied to wte


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of ``targets`` over every position, in float32."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()


def forward(params: dict[str, jax.Array], inputs: tuple, config: GPTConfigLike) -> jax.Array:
    """Logits (batch, length, vocab_size) for ``inputs = (idx,)``, as ``GPT(config)(idx)``."""
    (idx,) = inputs
    return _logits(params, idx, config)


def loss(params: dict[str, jax.Array], inputs: tuple, config: GPTConfigLike) -> jax.Array:
    """The training loss for ``inputs = (idx, targets)``, as ``GPT(config)(idx, targets)``: cross-entropy."""
    idx, targets = inputs
    return _cross_entropy(_logits(params, idx, config), targets)
