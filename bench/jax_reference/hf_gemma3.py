"""Hugging Face's ``Gemma3ForCausalLM`` written by hand in JAX as a JAX user writes it for a TPU: the token
embedding scaled by sqrt(width) in the parameters' dtype (the padding token's row learning nothing from it, as
``padding_idx`` has it), four RMSNorms a layer that scale by ``1 + weight`` in
float32 and round once, RMSNorm over each query and key head, the tanh-GELU gated MLP, heads of 256 scaled by
``query_pre_attn_scalar``, sliding-window and full layers by ``config.layer_types`` with a rotary base each, and
the output projection tied to the embedding. Attention is the splash kernel with a local or causal mask and the
padding as segment ids (``hf_decoder._splash_attention``).

``params`` is keyed like the torch model's ``dict(model.named_parameters())`` (the tied head appears once, as
``model.embed_tokens.weight``). Inputs are ``(tokens, attention_mask)`` and, for the loss, ``targets``.
"""

import math

import jax
import jax.numpy as jnp

from . import hf_decoder


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _logits(params: dict[str, jax.Array], tokens: jax.Array, valid: jax.Array, config) -> jax.Array:
    if config.attn_logit_softcapping is not None or config.final_logit_softcapping is not None:
        raise NotImplementedError("the Gemma 3 reference has no logit soft-capping (Gemma 3 configs leave it off)")
    batch, length = tokens.shape
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps, scale = config.rms_norm_eps, config.query_pre_attn_scalar ** -0.5
    embedding = params["model.embed_tokens.weight"]
    x = embedding[tokens]
    if config.pad_token_id is not None:  # torch's padding_idx: the padding token's row gets no gradient from here
        x = jnp.where((tokens == config.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
    x = x * jnp.asarray(math.sqrt(config.hidden_size), embedding.dtype)
    tables = {kind: hf_decoder._rope_tables(config, length, x.dtype, rope["rope_theta"])
              for kind, rope in config.rope_parameters.items()}
    for layer, kind in enumerate(config.layer_types):
        prefix = f"model.layers.{layer}"
        window = config.sliding_window if kind == "sliding_attention" else None
        h = _rms_norm(x, params[f"{prefix}.input_layernorm.weight"], eps)

        def project(name, count, h=h, prefix=prefix):
            y = hf_decoder._linear(h, params[f"{prefix}.self_attn.{name}.weight"])
            return y.reshape(batch, length, count, head_dim).transpose(0, 2, 1, 3)

        q = _rms_norm(project("q_proj", heads), params[f"{prefix}.self_attn.q_norm.weight"], eps)
        k = _rms_norm(project("k_proj", kv_heads), params[f"{prefix}.self_attn.k_norm.weight"], eps)
        v = project("v_proj", kv_heads)
        cos, sin = tables[kind]
        q, k = hf_decoder._rope(q, cos, sin), hf_decoder._rope(k, cos, sin)
        attended = hf_decoder._splash_attention(q, k, v, valid, window, scale)
        attended = hf_decoder._linear(attended.transpose(0, 2, 1, 3).reshape(batch, length, -1),
                                      params[f"{prefix}.self_attn.o_proj.weight"])
        x = x + _rms_norm(attended, params[f"{prefix}.post_attention_layernorm.weight"], eps)
        h = _rms_norm(x, params[f"{prefix}.pre_feedforward_layernorm.weight"], eps)
        gate = jax.nn.gelu(hf_decoder._linear(h, params[f"{prefix}.mlp.gate_proj.weight"]), approximate=True)
        mlp = hf_decoder._linear(gate * hf_decoder._linear(h, params[f"{prefix}.mlp.up_proj.weight"]),
                                 params[f"{prefix}.mlp.down_proj.weight"])
        x = x + _rms_norm(mlp, params[f"{prefix}.post_feedforward_layernorm.weight"], eps)
    x = _rms_norm(x, params["model.norm.weight"], eps)
    return hf_decoder._linear(x, embedding)


forward, loss = hf_decoder.entry_points(_logits)
