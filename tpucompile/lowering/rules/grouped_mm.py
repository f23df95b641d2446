"""Hugging Face Transformers' grouped matmul (``transformers::grouped_mm_fallback``) and its backward, as
``jax.lax.ragged_dot``.

Transformers' mixture-of-experts layers multiply the tokens routed to each expert by that expert's weights
through this custom op when ``grouped_mm`` is unavailable (always under ``torch.compile`` with float32
weights). Its implementation loops over the offsets on the host (``offs.tolist()``), so it cannot be traced
into the graph; a ragged dot is the same product: rows ``offs[i-1]:offs[i]`` of ``input`` times
``weight[i]``, rows past the last offset zero. XLA computes it densely per group on CPUs and with its ragged
matmul on TPUs. Registered by name (``custom_ops``), so it applies whenever transformers defines the op.
"""

from __future__ import annotations

from typing import Any

from tpucompile.lowering import custom_ops


def grouped_matmul(input: Any, weight: Any, offs: Any) -> Any:
    """``input`` rows grouped by the cumulative counts ``offs``, each group times its expert's weight."""
    import jax
    import jax.numpy as jnp

    group_sizes = jnp.diff(offs.astype(jnp.int32), prepend=0)
    precision = jax.lax.Precision.HIGHEST if input.dtype == jnp.float32 else None
    return jax.lax.ragged_dot(input, weight, group_sizes, precision=precision)


def grouped_matmul_backward(input: Any, weight: Any, offs: Any, grad_output: Any) -> tuple[Any, Any]:
    """The gradients of ``input`` and ``weight``, from the ragged dot's own derivative."""
    import jax

    _, pullback = jax.vjp(lambda a, b: grouped_matmul(a, b, offs), input, weight)
    return pullback(grad_output)


custom_ops.register_lowering("transformers::grouped_mm_fallback", grouped_matmul)
custom_ops.register_lowering("transformers::grouped_mm_fallback_backward", grouped_matmul_backward)
