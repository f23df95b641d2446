"""Route ``scaled_dot_product_attention`` in Dynamo's graph to its math form before AOTAutograd.

On the CPU, PyTorch dispatches attention to a fused kernel whose backward is another fused kernel; a
decomposition table only applies below autograd, so the backward graph would hold that kernel. Rewriting the
call in the torch-level graph makes autograd differentiate the math form (matmul, softmax, matmul), which
lowers to ordinary StableHLO and lets XLA fuse it.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from tpucompile.frontend.decompositions import scaled_dot_product_attention

_ATTENTION_TARGETS = {
    F.scaled_dot_product_attention,
    torch._C._nn.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
}


def rewrite_attention(gm: torch.fx.GraphModule) -> int:
    """Point every attention call at ``scaled_dot_product_attention``; returns how many were rewritten."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _ATTENTION_TARGETS:
            node.target = scaled_dot_product_attention
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
