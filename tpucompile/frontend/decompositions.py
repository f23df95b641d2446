"""The decomposition table AOTAutograd traces with: PyTorch's core ATen table plus our own choices.

Ops we lower whole (softmax, layer norm, GELU) are kept out of the table so XLA sees them as one unit; ops
whose PyTorch decomposition is what we would write by hand (batch norm, embedding, dropout) are taken from
``torch._decomp``. ``scaled_dot_product_attention`` (below) is the math form that
``attention.rewrite_attention`` substitutes for the fused kernel before autograd runs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

from tpucompile.frontend import traced_implementations
from tpucompile.frontend.foreach_ops import foreach_decompositions
from tpucompile.frontend.fractional_pooling import fractional_pooling_decompositions
from tpucompile.frontend.fused_attention import fused_attention_decompositions
from tpucompile.frontend.fused_layers import fused_layer_decompositions

aten = torch.ops.aten

_FROM_TORCH = [
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit,
    aten.native_batch_norm,
    aten.native_group_norm,
    aten.embedding,
    aten.native_dropout,
    aten.index_select,
]

# Lowered directly (one fused unit for XLA); the core table would otherwise break them up.
LOWERED_WHOLE = [
    aten._softmax.default,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,  # computed in f32 for bf16/f16, as eager's kernels do
    aten._log_softmax_backward_data.default,
    aten.native_layer_norm.default,
    aten.gelu.default,
    aten.roll.default,  # slices + concatenate; the core table's version is a gather
    aten.take.default,  # the table's version indexes with a 0-d tensor, which Dynamo turns into .item()
]


def attention_scale(query: torch.Tensor, scale: float | None) -> float:
    """``scale``, or attention's default ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def grouped_key_value(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """With ``enable_gqa``, key and value heads repeated so that each serves its group of query heads."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    return key, value


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention as matmul → (mask) → softmax → (dropout) → matmul, which autograd differentiates."""
    scale = attention_scale(query, scale)
    key, value = grouped_key_value(query, key, value, enable_gqa)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    return torch.matmul(_attention_weights(scores, attn_mask, dropout_p, is_causal), value)


def grouped_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """The math form of grouped-query attention, without repeating the keys and values per query head: each
    key/value head serves a group of consecutive query heads (as ``repeat_kv`` and ``enable_gqa`` lay them out),
    so the group's queries are rows of one product with that head's keys and values. The same scores as the
    repeated form, but no copy of the keys and values per query head (a decoding step's cache, the whole bucket
    of it, read once per key/value head), and their gradients summed by the products. The rows are ordered head
    first, then query position, so the scores split back into heads as the repeated form's are laid out."""
    scale = attention_scale(query, scale)
    *batch, heads, length_q, dim = query.shape
    key_heads, length_k = key.shape[-3], key.shape[-2]
    rows = query.reshape(*batch, key_heads, heads // key_heads * length_q, dim)
    scores = torch.matmul(rows, key.transpose(-2, -1)).reshape(*batch, heads, length_q, length_k) * scale
    weights = _attention_weights(scores, attn_mask, dropout_p, is_causal)
    out = torch.matmul(weights.reshape(*batch, key_heads, heads // key_heads * length_q, length_k), value)
    return out.reshape(*batch, heads, length_q, value.shape[-1])


def _attention_weights(scores: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
                       is_causal: bool) -> torch.Tensor:
    """Attention's probabilities from its scaled scores (..., queries, keys): the causal band and the mask
    applied, softmax over the keys, dropout."""
    if is_causal:
        causal = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
        weights = _softmax_of_masked(scores)
    else:
        weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p)
    return weights


def _softmax_of_masked(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, 0 on rows whose every score is -inf (a query that sees no key: a padded row
    under a causal mask), as PyTorch's attention gives; the plain softmax gives NaN there, forward and
    backward."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    exponentials = torch.exp(scores - row_max)
    total = exponentials.sum(dim=-1, keepdim=True)
    return exponentials / torch.where(total == 0, torch.ones_like(total), total)


def batch_norm_functional(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """``_native_batch_norm_legit_functional`` as torch decomposes it, except that with low-precision
    activations and f32 parameters the saved mean and rstd stay f32, as eager's CPU kernel keeps them
    (torch's decomposition rounds them to bf16 on CPU, and the backward then loses ~3 bits on weight.grad).
    """
    mixed = weight is not None and weight.dtype != input.dtype and input.dtype in (torch.bfloat16, torch.float16)
    if not training or not mixed:
        return _TORCH_BATCH_NORM(input, weight, bias, running_mean, running_var, training, momentum, eps)
    dims = [0, *range(2, input.dim())]
    var, mean = torch.var_mean(input.float(), dim=dims, correction=0, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    params_shape = [1, -1] + [1] * (input.dim() - 2)
    output = (input - mean) * rstd * weight.reshape(params_shape)
    if bias is not None:
        output = output + bias.reshape(params_shape)
    save_mean, save_rstd = mean.squeeze(dims), rstd.squeeze(dims)
    count = input.numel() / input.shape[1]
    new_mean = momentum * save_mean + (1 - momentum) * running_mean
    new_var = momentum * var.squeeze(dims) * (count / (count - 1)) + (1 - momentum) * running_var
    return output.to(input.dtype), save_mean, save_rstd, new_mean, new_var


_TORCH_BATCH_NORM = get_decompositions([aten._native_batch_norm_legit_functional])[
    aten._native_batch_norm_legit_functional.default
]


def unique_consecutive_normalized_dim(
    input: torch.Tensor, return_inverse: bool = False, return_counts: bool = False, dim: int | None = None
) -> Any:
    """``unique_consecutive`` with a negative ``dim`` made positive: PyTorch's meta function builds the
    wrong result shape for a negative ``dim`` (``[u0, 5]`` for a 1-d input), which the eager kernel does not."""
    if dim is None or dim >= 0:
        return NotImplemented
    return aten.unique_consecutive.default(input, return_inverse, return_counts, dim % max(input.dim(), 1))


def nll_loss_backward(
    grad_output: torch.Tensor,
    self: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """The gradient of ``nll_loss`` (and ``nll_loss2d``) with the target's one-hot built by comparing a class
    index range with the target, where PyTorch's decomposition scatters into a tensor of zeros: a comparison
    is elementwise, so XLA fuses it into the log-softmax backward that consumes it, instead of writing a
    zeros tensor of the logits' size and scattering into it (for a language model's head, two extra passes
    over ``tokens x vocabulary``). Same values: ``-grad * weight[target]`` at the target class, 0 elsewhere
    and on ignored targets."""
    channel_dim = 0 if self.dim() < 2 else 1
    if reduction == 1:  # mean
        grad_output = grad_output / total_weight
    if self.dim() == 1 and target.dim() > 0:  # no batch dim: the kernel reads target[0] only
        target = target[0]
    target = target.unsqueeze(channel_dim)
    kept = target != ignore_index
    shape = [1] * self.dim()
    shape[channel_dim] = self.shape[channel_dim]
    classes = torch.arange(self.shape[channel_dim], device=self.device, dtype=target.dtype).reshape(shape)
    hit = (classes == torch.where(kept, target, 0)) & kept
    if self.dim() > grad_output.dim() > 0:
        grad_output = grad_output.unsqueeze(channel_dim)
    if weight is not None:
        grad_output = grad_output * weight.reshape(shape)
    return torch.where(hit, -grad_output, 0).to(self.dtype)


def embedding_dense_backward(
    grad_output: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool
) -> torch.Tensor:
    """The embedding table's gradient, for bf16/f16 tables summed in f32 per token id and rounded once, as
    PyTorch's decomposition does, but without its f32 table: that zero-fills a ``num_weights x dim`` f32 tensor,
    scatters every token's row into it and rounds the whole table (for a language model's vocabulary, three
    passes over a table twice the weight's size, and twice its memory at the step's end, where memory peaks).

    Here the rows are summed in f32 per distinct id into a ``tokens x dim`` buffer (the ids sorted, each
    token's group numbered by a running count of where the sorted id changes), and each group's rounded sum
    is added into narrow zeros at its id: each row of the table receives one sum and zeros, so it is exact.
    Rows of ``padding_idx`` and ids out of range contribute nothing, as in PyTorch. f32/f64 tables,
    ``scale_grad_by_freq`` and runtime-sized token counts (a bucketed program, whose padding a sort would mix
    in) take PyTorch's decomposition."""
    result_dtype = grad_output.dtype
    symbolic = any(isinstance(size, torch.SymInt) for size in grad_output.shape)
    if result_dtype not in (torch.bfloat16, torch.float16) or scale_grad_by_freq or symbolic:
        return _TORCH_EMBEDDING_BACKWARD(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    ids = indices.reshape(-1).long()
    row_shape = grad_output.shape[indices.dim():]
    width = math.prod(row_shape)
    rows = grad_output.reshape(ids.shape[0], width).float()
    kept = (ids >= 0) & (ids < num_weights) & (ids != padding_idx)
    ids = torch.where(kept, ids, 0)
    rows = torch.where(kept.unsqueeze(1), rows, 0)
    sorted_ids, order = torch.sort(ids, stable=True)
    starts = torch.cat([torch.ones_like(kept[:1]), sorted_ids[1:] != sorted_ids[:-1]])
    group_in_order = torch.cumsum(starts.long(), 0) - 1
    group = torch.zeros_like(group_in_order).index_put((order,), group_in_order)
    sums = rows.new_zeros(rows.shape).index_put((group,), rows, accumulate=True)
    first_sums = torch.where(starts.unsqueeze(1), sums[group_in_order], 0).to(result_dtype)
    table = grad_output.new_zeros((num_weights, width)).index_put((sorted_ids,), first_sums, accumulate=True)
    return table.reshape((num_weights, *row_shape))


_TORCH_EMBEDDING_BACKWARD = get_decompositions([aten.embedding_dense_backward])[aten.embedding_dense_backward.default]


def weight_norm_interface(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``_weight_norm_interface`` as torch decomposes it, except that a 1-d ``v`` (nothing to reduce besides
    ``dim``) keeps one norm per element, as eager's kernel does: the table's ``v.norm(2, ())`` reduces over
    all of it. The norm is returned for the backward, which reads it (``_weight_norm_interface_backward``)."""
    dims = [d for d in range(v.dim()) if d != dim]
    norm_dtype = torch.float if g.dtype == torch.bfloat16 else None
    norm = v.norm(2, dims, keepdim=True, dtype=norm_dtype) if dims else v.abs().to(norm_dtype or v.dtype)
    return v * (g / norm.to(g.dtype)), norm


def fused_multiply_add(a: torch.Tensor, b: Any, c: torch.Tensor) -> torch.Tensor:
    """Inductor's ``prims.fma``, which Dynamo writes for ``addcmul_(..., value=v)`` (every Adam step): its eager
    implementation, ``a * b + c``."""
    return a * b + c


def decomposition_table(lowered_custom_ops: frozenset[str] = frozenset(), attention_kernel: bool = False,
                        compact_embedding_grad: bool = True) -> dict[torch._ops.OpOverload, Callable]:
    """The table handed to AOTAutograd (treat it as read-only). ``prims.fma`` exists only once Dynamo has
    imported Inductor's prims (as it does when it first traces an ``addcmul_`` with a value), so the table
    is built anew, once, when it appears. Custom ops (``torch.library.custom_op``) not named in
    ``lowered_custom_ops`` are traced through their implementations (``traced_implementations``); the table is built
    anew when those ops or their implementations change. With ``attention_kernel``, PyTorch's fused attention
    kernels go to the TPU kernel op where it takes them (``fused_attention``); with ``compact_embedding_grad``,
    low-precision embedding gradients are summed per token id (``embedding_dense_backward``)."""
    fma = getattr(torch.ops.prims, "fma", None)
    return _table(fma.default if fma is not None else None, traced_implementations.traced_ops(lowered_custom_ops),
                  attention_kernel, compact_embedding_grad)


@functools.cache
def _table(fma: torch._ops.OpOverload | None, traced: tuple[tuple[str, str], ...], attention_kernel: bool,
           compact_embedding_grad: bool) -> dict[torch._ops.OpOverload, Callable]:
    table = dict(core_aten_decompositions())
    table.update(traced_implementations.traced_implementations(traced))
    if fma is not None:
        table[fma] = fused_multiply_add
    table.update(get_decompositions(_FROM_TORCH))
    for op in LOWERED_WHOLE:
        table.pop(op, None)
    table[aten._native_batch_norm_legit_functional.default] = batch_norm_functional
    table[aten.unique_consecutive.default] = unique_consecutive_normalized_dim
    table[aten.nll_loss_backward.default] = nll_loss_backward
    table[aten.nll_loss2d_backward.default] = nll_loss_backward
    table[aten._weight_norm_interface.default] = weight_norm_interface
    if compact_embedding_grad:
        table[aten.embedding_dense_backward.default] = embedding_dense_backward
    table.update(fused_attention_decompositions(attention_kernel))
    table.update(fused_layer_decompositions())
    table.update(fractional_pooling_decompositions())
    table.update(foreach_decompositions())
    return table
