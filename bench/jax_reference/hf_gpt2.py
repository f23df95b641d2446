"""Hugging Face's ``GPT2LMHeadModel`` written by hand in JAX as a JAX user writes it for a TPU: learned
positions, pre-LayerNorm blocks with biases, the tanh GELU, heads of 64, the output projection tied to the token
embedding; attention is the splash kernel with a causal mask and the padding as segment ids
(``hf_decoder._splash_attention``). Dropout is off on both sides (the benchmark's config sets it to 0).

``params`` is keyed like the torch model's ``dict(model.named_parameters())`` (the tied head appears once, as
``transformer.wte.weight``). Inputs are ``(tokens, attention_mask)`` and, for the loss, ``targets``.
LayerNorm is the example GPT reference's (float32, rounded once).
"""

import jax

from . import hf_decoder
from .mingpt import _layer_norm


def _conv1d(x: jax.Array, params: dict[str, jax.Array], name: str) -> jax.Array:
    """transformers' ``Conv1D``: a linear layer whose weight is stored (in, out)."""
    return x @ params[f"{name}.weight"] + params[f"{name}.bias"]


def _logits(params: dict[str, jax.Array], tokens: jax.Array, valid: jax.Array, config) -> jax.Array:
    batch, length = tokens.shape
    heads, eps = config.n_head, config.layer_norm_epsilon
    head_dim = config.n_embd // heads
    x = params["transformer.wte.weight"][tokens] + params["transformer.wpe.weight"][:length]
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}"
        h = _layer_norm(x, params[f"{prefix}.ln_1.weight"], params[f"{prefix}.ln_1.bias"], eps)
        qkv = _conv1d(h, params, f"{prefix}.attn.c_attn").reshape(batch, length, 3, heads, head_dim)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        attended = hf_decoder._splash_attention(q, k, v, valid, None)
        x = x + _conv1d(attended.transpose(0, 2, 1, 3).reshape(batch, length, -1), params, f"{prefix}.attn.c_proj")
        h = _layer_norm(x, params[f"{prefix}.ln_2.weight"], params[f"{prefix}.ln_2.bias"], eps)
        x = x + _conv1d(jax.nn.gelu(_conv1d(h, params, f"{prefix}.mlp.c_fc"), approximate=True), params,
                        f"{prefix}.mlp.c_proj")
    x = _layer_norm(x, params["transformer.ln_f.weight"], params["transformer.ln_f.bias"], eps)
    return x @ params["transformer.wte.weight"].T


forward, loss = hf_decoder.entry_points(_logits)
