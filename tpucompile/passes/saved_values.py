"""A check on backward ops that run in eager PyTorch: do the values they read look like what their fused
forward saved for them?

A fused kernel's backward (attention's, say) reads values only its own forward computes: the output and a
log-sum-exp per query row. If the forward was decomposed into other ops while the backward stays the fused
op, the backward may be handed values of another meaning, and PyTorch's kernel reads them without complaint:
the gradients come out wrong, silently. tpucompile decomposes both halves of every pair it knows
(``frontend.fused_attention``); this check is the guard for any pair that still meets across the boundary.
It compares each saved value's shape and dtype with what the forward's schema promises for it.
"""

from __future__ import annotations

import math

import torch
import torch.fx


def _shape(node: torch.fx.Node, name: str) -> tuple[torch.Size | None, torch.dtype | None]:
    value = _argument(node, name)
    value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
    return (value.shape, value.dtype) if isinstance(value, torch.Tensor) else (None, None)


def _argument(node: torch.fx.Node, name: str):
    schema = node.target._schema
    for index, argument in enumerate(schema.arguments):
        if argument.name == name:
            return node.args[index] if index < len(node.args) else node.kwargs.get(name)
    return None


def _attention_saved_values(node: torch.fx.Node, padded_rows: int) -> str | None:
    query, query_dtype = _shape(node, "query")
    value, _ = _shape(node, "value")
    out, out_dtype = _shape(node, "out")
    lse, lse_dtype = _shape(node, "logsumexp")
    if query is None or value is None or out is None or lse is None:
        return None
    expected_out = (*query[:-1], value[-1])
    if tuple(out) != expected_out or out_dtype != query_dtype:
        return (f"its saved output is {out_dtype} {list(out)}, where the forward gives {query_dtype} "
                f"{list(expected_out)}")
    rows = query[-2] if padded_rows == 1 else math.ceil(query[-2] / padded_rows) * padded_rows
    if tuple(lse) not in ((*query[:-1],), (*query[:-2], rows)) or lse_dtype not in (torch.float32, torch.float64):
        return (f"its saved log-sum-exp is {lse_dtype} {list(lse)}, where the forward gives a float "
                f"{[*query[:-2], rows]}")
    return None


_CHECKS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": lambda node: _attention_saved_values(node, 1),
    "aten::_scaled_dot_product_efficient_attention_backward": lambda node: _attention_saved_values(node, 32),
    "aten::_scaled_dot_product_flash_attention_backward": lambda node: _attention_saved_values(node, 1),
    "aten::_scaled_dot_product_cudnn_attention_backward": lambda node: _attention_saved_values(node, 1),
    "aten::_scaled_dot_product_fused_attention_overrideable_backward": lambda node: _attention_saved_values(node, 1),
}


def saved_value_mismatch(node: torch.fx.Node) -> str | None:
    """Why the fused backward op ``node`` must not run on the values it is given, or None (also for any node
    that is not a known fused backward)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    check = _CHECKS.get(node.target._schema.name)
    return check(node) if check is not None else None
