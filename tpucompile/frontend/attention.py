"""Route ``scaled_dot_product_attention`` in Dynamo's graph before AOTAutograd: to its math form, or to the
attention op whose lowering is a memory-efficient kernel.

On the CPU, PyTorch dispatches attention to a fused kernel whose backward is another fused kernel; a
decomposition table only applies below autograd, so the backward graph would hold that kernel. Rewriting the
call in the torch-level graph makes autograd differentiate the math form (matmul, softmax, matmul), which
lowers to ordinary StableHLO and lets XLA fuse it.

Where a program is compiled for a TPU, a call whose shapes the kernel takes goes instead to
``tpucompile::attention`` (``attention_ops``), kept whole through autograd with its own backward: its TPU
lowering is a flash-attention kernel that never writes the scores to memory and saves only the output and a
log-sum-exp per row for the backward. Everywhere else that op lowers to the math form.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from tpucompile import attention_ops
from tpucompile.frontend.decompositions import attention_scale, grouped_key_value, scaled_dot_product_attention
from tpucompile.frontend.transforms import runs_functorch_transform

_ATTENTION_TARGETS = {
    F.scaled_dot_product_attention,
    torch._C._nn.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
}
_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
KERNEL_BLOCK = 128
"""The kernel's tile along the sequence and head dims: lengths and head sizes must be multiples of it."""


def attention_with_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` through ``tpucompile::attention`` (only for calls ``kernel_takes``)."""
    key, value = grouped_key_value(query, key, value, enable_gqa)
    return attention_ops.attention(query, key, value, bool(is_causal), float(attention_scale(query, scale)))[0]


def kernel_takes(node: torch.fx.Node) -> str | None:
    """None when the attention call ``node`` fits the kernel, else why not."""
    bound = dict(zip(_PARAMETERS, node.args, strict=False))
    bound.update(node.kwargs)
    values = [_example(bound.get(name)) for name in ("query", "key", "value")]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return "query, key or value has no traced value"
    query, key, value = values
    if bound.get("attn_mask") is not None:
        return "it has an attention mask"
    if bound.get("dropout_p", 0.0) != 0.0 or not isinstance(bound.get("is_causal", False), bool):
        return "it has dropout or a traced is_causal"
    if not isinstance(bound.get("scale"), (int, float, type(None))):
        return "its scale is traced"
    if any(t.dim() != 4 for t in values) or query.dtype != key.dtype or key.dtype != value.dtype:
        return "it is not 4-d attention with one dtype"
    if query.dtype not in (torch.float32, torch.bfloat16):
        return f"{query.dtype} is not float32 or bfloat16"
    if any(isinstance(s, torch.SymInt) for t in values for s in t.shape):
        return "its sizes are symbolic"
    if key.shape[-3] != value.shape[-3] or (query.shape[-3] != key.shape[-3] and not (
            bound.get("enable_gqa") is True and query.shape[-3] % key.shape[-3] == 0)):
        return "its heads differ without grouped-query attention"
    if query.shape[-1] != key.shape[-1] or key.shape[-1] != value.shape[-1] or query.shape[-1] % KERNEL_BLOCK:
        return f"its head size is not one multiple of {KERNEL_BLOCK}"
    if query.shape[-2] % KERNEL_BLOCK or key.shape[-2] % KERNEL_BLOCK:
        return f"its lengths are not multiples of {KERNEL_BLOCK}"
    if bound.get("is_causal") and query.shape[-2] != key.shape[-2]:
        return "it is causal with unequal lengths"
    return None


def rewrite_attention(gm: torch.fx.GraphModule, kernel: bool = False) -> int:
    """Point every attention call at its math form, or with ``kernel`` each one the kernel takes at
    ``attention_with_kernel``; returns how many were rewritten. Each rewritten node records the choice in its
    meta (``"attention"``: ``"kernel"`` or ``"math: <why>"``), which the graph dump shows."""
    rewritten = 0
    transformed = runs_functorch_transform(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _ATTENTION_TARGETS:
            if not kernel:
                why_not = "no kernel for this target"
            elif transformed:  # torch.func.grad cannot differentiate a custom op's autograd formula
                why_not = "it is inside a torch.func transform"
            else:
                why_not = kernel_takes(node)
            node.target = attention_with_kernel if why_not is None else scaled_dot_product_attention
            node.meta["attention"] = "kernel" if why_not is None else f"math: {why_not}"
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _example(value: Any) -> Any:
    return value.meta.get("example_value", value.meta.get("val")) if isinstance(value, torch.fx.Node) else value
