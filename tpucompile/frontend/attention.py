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

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

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
    return _kernel_refusal(node.args, node.kwargs, _example)


def _kernel_refusal(args: tuple, kwargs: dict[str, Any], example: Callable[[Any], Any] = lambda v: v) -> str | None:
    """None when attention called with ``args`` and ``kwargs`` fits the kernel, else why not; ``example`` maps
    an argument to the (fake) tensor it stands for."""
    bound = dict(zip(_PARAMETERS, args, strict=False))
    bound.update(kwargs)
    values = [example(bound.get(name)) for name in ("query", "key", "value")]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return "query, key or value has no traced value"
    query, key, value = values
    if bound.get("attn_mask") is not None:
        return "it has an attention mask"
    if bound.get("dropout_p", 0.0) != 0.0 or not isinstance(bound.get("is_causal", False), bool):
        return "it has dropout or a traced is_causal"
    if not isinstance(bound.get("scale"), (int, float, type(None))):
        return "its scale is traced"
    if (all(t.dim() == 4 for t in values) and query.shape[-3] != key.shape[-3]
            and bound.get("enable_gqa") is not True):
        return "its heads differ without grouped-query attention"
    return attention_ops.kernel_refusal(query, key, value, bool(bound.get("is_causal", False)))


class _RoutedAttention(TorchFunctionMode):
    """Sends each ``scaled_dot_product_attention`` call made while it is active to its math form, or with
    ``kernel`` each one the kernel takes to ``attention_with_kernel``."""

    def __init__(self, kernel: bool) -> None:
        super().__init__()
        self.kernel = kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ATTENTION_TARGETS:
            kernel = self.kernel and _kernel_refusal(args, kwargs) is None
            return (attention_with_kernel if kernel else scaled_dot_product_attention)(*args, **kwargs)
        return func(*args, **kwargs)


def multi_head_attention_math(*args: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward`` with the attention inside it in its math form."""
    with _RoutedAttention(kernel=False):
        return F.multi_head_attention_forward(*args, **kwargs)


def multi_head_attention_with_kernel(*args: Any, **kwargs: Any) -> Any:
    """``F.multi_head_attention_forward`` with the attention inside it sent to the kernel where it fits."""
    with _RoutedAttention(kernel=True):
        return F.multi_head_attention_forward(*args, **kwargs)


_HIDING_ATTENTION = {F.multi_head_attention_forward: (multi_head_attention_math, multi_head_attention_with_kernel)}
"""Functions Dynamo keeps as one call though they call attention inside: their math and kernel routings."""


def rewrite_attention(gm: torch.fx.GraphModule, kernel: bool = False) -> int:
    """Point every attention call at its math form, or with ``kernel`` each one the kernel takes at
    ``attention_with_kernel``; returns how many were rewritten. Each rewritten node records the choice in its
    meta (``"attention"``: ``"kernel"`` or ``"math: <why>"``), which the graph dump shows. Calls that hide
    attention inside them (``F.multi_head_attention_forward``) run with their attention routed the same way:
    otherwise PyTorch's fused kernel would reach autograd, whose backward is another fused kernel."""
    rewritten = 0
    transformed = runs_functorch_transform(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _HIDING_ATTENTION:
            routed = kernel and not transformed
            node.target = _HIDING_ATTENTION[node.target][routed]
            node.meta["attention"] = "routed inside: kernel where it fits" if routed else "routed inside: math"
            rewritten += 1
        elif node.op == "call_function" and node.target in _ATTENTION_TARGETS:
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
