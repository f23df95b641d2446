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

The kernel never reads a mask tensor: a call with one takes the kernel only where ``attention_masks``
proves from the graph that the mask is a causal or sliding-window band and/or a padding mask per batch row,
which the op describes instead. Keys and values that the model repeated per query head (Hugging Face's
``repeat_kv``: an unsqueeze, expand and reshape) go to the op unrepeated, as grouped-query attention.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tpucompile.contracts import attention_ops
from tpucompile.frontend.attention_masks import MaskPlan, prove_mask
from tpucompile.frontend.decompositions import (
    attention_scale,
    grouped_query_attention,
    scaled_dot_product_attention,
)
from tpucompile.passes.dead_code import drop_unread

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
    """``scaled_dot_product_attention`` without a mask through ``tpucompile::attention`` (only for calls
    ``_kernel_refusal`` passes)."""
    return attention_ops.attention_with_grad(query, key, value, None, -1, 0 if is_causal else -1,
                                             float(attention_scale(query, scale)))[0]


def attention_with_plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_valid: torch.Tensor | None,
                        left: int, right: int, scale: float) -> torch.Tensor:
    """Attention with a proved mask (``MaskPlan``) through ``tpucompile::attention``."""
    return attention_ops.attention_with_grad(query, key, value, kv_valid, left, right, scale)[0]


def attention_with_scaled_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                kv_valid: torch.Tensor | None, left: int, right: int, scale: float) -> torch.Tensor:
    """``attention_with_plan`` with the query scaled by an op of the graph and the kernel run with scale 1.
    The kernel takes its query scaled; scaled here, the forward saves the scaled query for the backward, so
    the multiply happens once, where XLA fuses it into the query's own producer, instead of in each program's
    kernel lowering apart from it (option ``prescale_attention_query``)."""
    return attention_ops.attention_with_grad(query * scale, key, value, kv_valid, left, right, 1.0)[0]


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """How an attention node goes to the kernel: its (unrepeated) key and value and its proved mask."""

    key: torch.fx.Node
    value: torch.fx.Node
    plan: MaskPlan
    scale: float


def kernel_call(node: torch.fx.Node) -> KernelCall | str:
    """How the attention call ``node`` goes to the kernel, else why it does not."""
    bound = _bound(node.args, node.kwargs)
    query, key, value, mask = (bound.get(name) for name in ("query", "key", "value", "attn_mask"))
    examples = [_example(v) for v in (query, key, value)]
    if not all(isinstance(v, torch.fx.Node) for v in (query, key, value)):
        return "query, key or value has no traced value"
    refusal = _arguments_refusal(bound, examples)
    if refusal is not None:
        return refusal
    if examples[0].dim() != 4:
        return "it is not 4-d attention"
    heads = examples[0].shape[-3]
    key_heads, value_heads = _unrepeated(key, value, heads)
    causal = bool(bound.get("is_causal", False))
    batch, length_q, length_k = examples[0].shape[0], examples[0].shape[-2], examples[1].shape[-2]
    if mask is None:
        plan = MaskPlan(None, -1, 0 if causal else -1)
    elif not isinstance(mask, torch.fx.Node) or not isinstance(_example(mask), torch.Tensor):
        return "its mask has no traced value"
    else:
        additive = _example(mask).dtype != torch.bool
        proved = prove_mask(mask, (batch, heads, length_q, length_k), additive=additive, causal=causal)
        if isinstance(proved, str):
            return f"its mask is not proved a band or padding: {proved}"
        plan = proved
    refusal = attention_ops.kernel_refusal(examples[0], _example(key_heads), _example(value_heads),
                                           plan.left >= 0 or plan.right >= 0)
    if refusal is not None:
        return refusal
    return KernelCall(key_heads, value_heads, plan, float(attention_scale(examples[0], bound.get("scale"))))


def _unrepeated(key: torch.fx.Node, value: torch.fx.Node, heads: int) -> tuple[torch.fx.Node, torch.fx.Node]:
    """The key and value before a ``repeat_kv`` made them (``_ungrouped``) when both were repeated alike; the
    nodes themselves otherwise."""
    key_heads, value_heads = _ungrouped(key, heads), _ungrouped(value, heads)
    if _example(key_heads).shape[-3] != _example(value_heads).shape[-3]:
        return key, value
    return key_heads, value_heads


def _ungrouped(node: torch.fx.Node, heads: int) -> torch.fx.Node:
    """The key or value a ``repeat_kv`` (``x[:, :, None].expand(b, kv, g, n, d).reshape(b, kv * g, n, d)``)
    or ``repeat_interleave(g, dim=1)`` made ``node`` from; ``node`` itself otherwise."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name == "repeat_interleave" and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0]
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if dim in (1, -3) and _example(source).dim() == 4 and heads % _example(source).shape[1] == 0:
            return source
        return node
    if name not in ("reshape", "view") or not isinstance(node.args[0], torch.fx.Node):
        return node
    expanded = node.args[0]
    expand_name = expanded.target if expanded.op == "call_method" else ""
    if expand_name != "expand" or not isinstance(expanded.args[0], torch.fx.Node):
        return node
    inserted = expanded.args[0]
    if inserted.op == "call_function" and inserted.target is operator.getitem:
        source, index = inserted.args
        full = slice(None)
        if index != (full, full, None, full, full) and index != (full, full, None):
            return node
    elif inserted.op == "call_method" and inserted.target == "unsqueeze" and tuple(inserted.args[1:]) == (2,):
        source = inserted.args[0]
    else:
        return node
    if not isinstance(source, torch.fx.Node):
        return node
    shape = tuple(_example(source).shape)
    if len(shape) != 4 or heads % shape[1] or tuple(_example(expanded).shape) != (
            shape[0], shape[1], heads // shape[1], shape[2], shape[3]) or tuple(_example(node).shape) != (
            shape[0], heads, shape[2], shape[3]):
        return node
    return source


def _bound(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """An attention call's arguments by parameter name."""
    bound = dict(zip(_PARAMETERS, args, strict=False))
    bound.update(kwargs)
    return bound


def _arguments_refusal(bound: dict[str, Any], values: list[Any]) -> str | None:
    """Why an attention call with arguments ``bound`` (query, key and value standing for the tensors
    ``values``) cannot take the kernel whatever its mask and shapes, else None."""
    if not all(isinstance(v, torch.Tensor) for v in values):
        return "query, key or value has no traced value"
    if bound.get("dropout_p", 0.0) != 0.0 or not isinstance(bound.get("is_causal", False), bool):
        return "it has dropout or a traced is_causal"
    if not isinstance(bound.get("scale"), (int, float, type(None))):
        return "its scale is traced"
    query, key, _ = values
    if (all(t.dim() == 4 for t in values) and query.shape[-3] != key.shape[-3]
            and bound.get("enable_gqa") is not True):
        return "its heads differ without grouped-query attention"
    return None


def _kernel_refusal(args: tuple, kwargs: dict[str, Any]) -> str | None:
    """None when attention called with tensors ``args`` and ``kwargs`` and no mask fits the kernel, else why
    not."""
    bound = _bound(args, kwargs)
    values = [bound.get(name) for name in ("query", "key", "value")]
    if bound.get("attn_mask") is not None:
        return "it has an attention mask"
    refusal = _arguments_refusal(bound, values)
    if refusal is not None:
        return refusal
    return attention_ops.kernel_refusal(*values, bool(bound.get("is_causal", False)))


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


GROUPED_QUERIES_PER_KEY = 4
"""The grouped math form is taken when the query length is fixed and at most a quarter of the key length (or
the key length is runtime-sized: a decoding step's growing cache). There the keys and values are the traffic;
with as many queries as keys (a training step, a prompt) the scores are, and on the TPU estimate the grouped
form then gained nothing in cycles and read 5-12% more bytes (the query and output transposed into groups)."""


def grouped_key_value_nodes(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """The key and value of the attention call ``node`` with one head per group of query heads, when its
    keys and values are grouped (given so with ``enable_gqa``, or repeated per query head by ``repeat_kv``:
    ``_ungrouped``) and its queries are few against its keys (``GROUPED_QUERIES_PER_KEY``); None otherwise.
    A runtime-sized query length never qualifies: under buckets the query rows of a group would merge the
    padded length inside the heads."""
    bound = _bound(node.args, node.kwargs)
    query, key, value = (bound.get(name) for name in ("query", "key", "value"))
    if not all(isinstance(v, torch.fx.Node) for v in (query, key, value)):
        return None
    examples = [_example(v) for v in (query, key, value)]
    if not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in examples):
        return None
    heads, length_q, length_k = examples[0].shape[-3], examples[0].shape[-2], examples[1].shape[-2]
    if not isinstance(heads, int) or not isinstance(length_q, int):
        return None
    if isinstance(length_k, int) and length_k < GROUPED_QUERIES_PER_KEY * length_q:
        return None
    if bound.get("enable_gqa") is not True:
        key, value = _unrepeated(key, value, heads)
    key_heads, value_heads = _example(key).shape[-3], _example(value).shape[-3]
    if not isinstance(key_heads, int) or key_heads != value_heads or key_heads >= heads or heads % key_heads:
        return None
    return key, value


def rewrite_attention(gm: torch.fx.GraphModule, kernel: bool = False, prescale_query: bool = False,
                      group_queries: bool = True) -> int:
    """Point every attention call at its math form, or with ``kernel`` each one the kernel takes at
    ``attention_with_plan`` (``attention_with_scaled_query`` with ``prescale_query``); returns how many were
    rewritten. With ``group_queries``, a math-form call whose keys and values are grouped (repeated per query
    head by ``repeat_kv``, or given with ``enable_gqa``) takes them unrepeated, as ``grouped_query_attention``.
    Each rewritten node records the choice in its meta (``"attention"``: ``"kernel"`` or
    ``"math: <why>"``), which the graph dump shows. Calls that hide attention inside them
    (``F.multi_head_attention_forward``) run with their attention routed the same way: otherwise PyTorch's
    fused kernel would reach autograd, whose backward is another fused kernel."""
    rewritten = 0
    replaced: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _HIDING_ATTENTION:
            node.target = _HIDING_ATTENTION[node.target][kernel]
            node.meta["attention"] = "routed inside: kernel where it fits" if kernel else "routed inside: math"
            rewritten += 1
        elif node.op == "call_function" and node.target in _ATTENTION_TARGETS:
            call = kernel_call(node) if kernel else "no kernel for this target"
            if isinstance(call, KernelCall):
                replaced.extend(a for a in node.all_input_nodes)
                query = node.args[0] if node.args else node.kwargs["query"]
                node.target = attention_with_scaled_query if prescale_query else attention_with_plan
                node.args = (query, call.key, call.value, call.plan.kv_valid, call.plan.left, call.plan.right,
                             call.scale)
                node.kwargs = {}
                node.meta["attention"] = f"kernel: {call.plan.describe()}"
            elif (grouped := grouped_key_value_nodes(node) if group_queries else None) is not None:
                replaced.extend(a for a in node.all_input_nodes)
                bound = _bound(node.args, node.kwargs)
                node.target = grouped_query_attention
                node.args = (bound["query"], *grouped, bound.get("attn_mask"), bound.get("dropout_p", 0.0),
                             bound.get("is_causal", False), bound.get("scale"))
                node.kwargs = {}
                node.meta["attention"] = f"math, grouped-query: {call}"
            else:
                node.target = scaled_dot_product_attention
                node.meta["attention"] = f"math: {call}"
            rewritten += 1
    if rewritten:
        drop_unread(gm, replaced)
        gm.recompile()
    return rewritten


def _example(value: Any) -> Any:
    return value.meta.get("example_value", value.meta.get("val")) if isinstance(value, torch.fx.Node) else value
