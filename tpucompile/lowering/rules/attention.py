"""``tpucompile::attention`` and its backward (``attention_ops``): jax's Pallas splash-attention kernel on
TPUs, the math form elsewhere, both lowered through jax (``jax_bridge``), so a program holding them is lowered
again for each platform it is compiled for.

The op's mask description maps onto splash attention's own masks, which the kernel turns into block
sparsity at trace time (blocks wholly outside a causal or sliding-window band are never loaded): a causal
band is a ``CausalMask``, any other band a ``LocalMask``, no band a ``FullMask``. A padding mask
(``kv_valid``) becomes segment ids: every query in segment 1, each key in segment 1 where it is valid and 0
where it is padding. Grouped-query attention runs the multi-query form of the kernel per key/value head,
so each key/value head is read once for its whole group of query heads. Splash attention takes the query
already scaled, as a JAX user scales it: by default the graph scales it before the op, which then carries
scale 1 and the lowering leaves the query as it is (``frontend/attention.py``, ``prescale_attention_query``).

The forward saves the kernel's log-sum-exp; the backward is the kernel family's own backward passes (dk/dv,
then dq), fed the saved output and log-sum-exp, as jax's custom VJP feeds them: no forward is recomputed.
Those passes are private to jax; where a jax version lacks them, the backward recomputes the forward
through the public kernel's ``jax.vjp`` instead (more flops, same values).

A query row that sees no key (every key it may see is padding) gets zeros and an ``lse`` of -inf, as PyTorch
gives; the kernel does not single such rows out, so the lowering applies that afterwards from the padding
mask's prefix sums (a pass over one flag per row, not over the scores).
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
from jax.extend.mlir import ir

from tpucompile.contracts import attention_ops  # noqa: F401  (registers the ops)
from tpucompile.lowering import jax_bridge, shardy_attributes
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import spec_type

BLOCKS = (512, 256, 128)
"""Tile sizes along the sequence, largest first: the largest that divides the length is used."""


@register_rule(torch.ops.tpucompile.attention.default)
def _attention(ctx, query, key, value, kv_valid, left, right, scale):
    operands = [query, key, value] + ([kv_valid] if kv_valid is not None else [])
    return _call("attention", splash_forward, math_forward, operands, ctx, left, right, scale)


@register_rule(torch.ops.tpucompile.attention_backward.default)
def _attention_backward(ctx, grad_out, query, key, value, out, lse, kv_valid, left, right, scale):
    operands = [grad_out, query, key, value, out, lse] + ([kv_valid] if kv_valid is not None else [])
    return _call("attention_backward", splash_backward, math_backward, operands, ctx, left, right, scale)


def _call(name, kernel_fn, math_fn, operands, ctx, left: int, right: int, scale: float):
    """``kernel_fn`` on a TPU (or, where kernels are interpreted, anywhere in Pallas' interpret mode),
    ``math_fn`` elsewhere, as a call to a function lowered from jax. In a sharded program the kernel runs
    per shard (``_per_shard_call``)."""
    interpret = jax_bridge.interpreting_kernels()
    kernel = interpret or jax_bridge.current_platform() == "tpu"
    if kernel:
        fn = functools.partial(kernel_fn, left=left, right=right, scale=scale, interpret=interpret)
        name += "_splash_interpreted" if interpret else "_splash"
        mesh = shardy_attributes.module_mesh(jax_bridge.enclosing_module())
        if mesh is not None:
            return _per_shard_call(name, fn, operands, ctx, mesh, (left, right, scale))
    else:
        fn = functools.partial(math_fn, left=left, right=right, scale=scale)
        name += "_math"
    return tuple(jax_bridge.call(name, fn, operands, list(ctx.avals_out), params=(left, right, scale),
                                 x64=not kernel))


HEAD_AXES = ("model", "tensor")
"""Mesh axes that split the heads first (the name ``tensor_parallel`` gives its axis: a column-parallel
projection leaves each device its own heads); any other axis splits the batch first, as data parallelism
and FSDP lay out activations."""


def split_axes(mesh: tuple[tuple[str, int], ...], batch: int, kv_heads: int
               ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes splitting the batch, axes splitting the key/value heads) for a kernel call on ``mesh``: each axis,
    in mesh order, goes where it divides what is left (a ``HEAD_AXES`` axis to the heads first, any other to
    the batch first), else nowhere (the devices along it compute the same blocks). Splitting key/value heads
    keeps each group of query heads with its key/value head."""
    sizes = dict(mesh)
    batch_axes: list[str] = []
    head_axes: list[str] = []
    for name, size in mesh:
        room = {"batch": (batch, batch_axes), "heads": (kv_heads, head_axes)}
        for where in (("heads", "batch") if name in HEAD_AXES else ("batch", "heads")):
            extent, axes = room[where]
            if extent % (size * math.prod(sizes[axis] for axis in axes)) == 0:
                axes.append(name)
                break
    return tuple(batch_axes), tuple(head_axes)


def _per_shard_call(name, fn, operands, ctx, mesh, params):
    """The kernel on each device's block of batch rows and heads (``sdy.manual_computation``): XLA's
    partitioner cannot split a Pallas kernel's custom call, and would otherwise gather every operand and run
    the whole batch's attention on every device. Every operand and result is laid out ``(batch, heads, ...)``
    except the padding mask ``kv_valid`` (``(batch, keys)``)."""
    key = operands[2] if name.startswith("attention_backward") else operands[1]
    batch, kv_heads = ir.RankedTensorType(key.type).shape[:2]
    batch_axes, head_axes = split_axes(mesh, batch, kv_heads)

    def dims(type_: ir.Type) -> tuple[tuple[str, ...], ...]:
        """(batch, heads, ...) for the 3-d and 4-d operands and results; (batch, keys) for the padding mask."""
        return (batch_axes,) if len(ir.RankedTensorType(type_).shape) == 2 else (batch_axes, head_axes)

    result_types = [spec_type(spec) for spec in ctx.avals_out]

    def body(blocks):
        return jax_bridge.call(name, fn, blocks, None, params=params, x64=False)

    return tuple(shardy_attributes.per_shard(operands, [dims(v.type) for v in operands], result_types,
                                             [dims(t) for t in result_types], mesh, body))


# --- the math form -----------------------------------------------------------------------------------------


def _grouped(query, tensor):
    """Key or value heads repeated to the query's (query head ``h`` reads head ``h // group``)."""
    import jax.numpy as jnp

    groups = query.shape[1] // tensor.shape[1]
    return tensor if groups == 1 else jnp.repeat(tensor, groups, axis=1)


def _folded(grad, heads: int):
    """A gradient over repeated heads summed back onto each key or value head."""
    if grad.shape[1] == heads:
        return grad
    return grad.reshape(grad.shape[0], heads, grad.shape[1] // heads, *grad.shape[2:]).sum(axis=2)


def _keep(length_q: int, length_k: int, kv_valid, left: int, right: int):
    """The boolean mask the description stands for (broadcastable to the scores), or None."""
    import jax.numpy as jnp

    offset = jnp.arange(length_k)[None, :] - jnp.arange(length_q)[:, None]
    keep = None
    if left >= 0:
        keep = offset >= -left
    if right >= 0:
        keep = offset <= right if keep is None else keep & (offset <= right)
    if kv_valid is not None:
        valid = kv_valid.astype(bool)[:, None, None, :]
        keep = valid if keep is None else keep & valid
    return keep


def _scores(query, key, kv_valid, left: int, right: int, scale: float):
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", query, _grouped(query, key), preferred_element_type=jnp.float32)
    scores = scores * scale
    keep = _keep(scores.shape[-2], scores.shape[-1], kv_valid, left, right)
    return scores if keep is None else jnp.where(keep, scores, -jnp.inf)


def _probabilities(scores, lse):
    import jax.numpy as jnp

    return jnp.exp(scores - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None])


def math_forward(query, key, value, kv_valid=None, *, left: int, right: int, scale: float):
    """``(out, lse)`` of attention, the math form in float32 (matmuls accumulate in float32)."""
    import jax
    import jax.numpy as jnp

    scores = _scores(query, key, kv_valid, left, right, scale)
    lse = jax.nn.logsumexp(scores, axis=-1)
    out = jnp.einsum("bhqk,bhkd->bhqd", _probabilities(scores, lse), _grouped(query, value).astype(jnp.float32))
    return out.astype(query.dtype), lse


def math_backward(grad_out, query, key, value, out, lse, kv_valid=None, *, left: int, right: int, scale: float):
    """Gradients of query, key and value, the probabilities recomputed from ``lse``."""
    import jax.numpy as jnp

    probabilities = _probabilities(_scores(query, key, kv_valid, left, right, scale), lse)
    grad = grad_out.astype(jnp.float32)
    grad_value = jnp.einsum("bhqk,bhqd->bhkd", probabilities, grad)
    grad_probabilities = jnp.einsum("bhqd,bhkd->bhqk", grad, _grouped(query, value).astype(jnp.float32))
    row = jnp.sum(grad * out.astype(jnp.float32), axis=-1, keepdims=True)
    grad_scores = probabilities * (grad_probabilities - row) * scale
    grad_query = jnp.einsum("bhqk,bhkd->bhqd", grad_scores, _grouped(query, key).astype(jnp.float32))
    grad_key = jnp.einsum("bhqk,bhqd->bhkd", grad_scores, query.astype(jnp.float32))
    heads = key.shape[1]
    return (grad_query.astype(query.dtype), _folded(grad_key, heads).astype(key.dtype),
            _folded(grad_value, heads).astype(value.dtype))


# --- the splash kernel -------------------------------------------------------------------------------------


def _splash():
    from jax.experimental.pallas.ops.tpu import splash_attention

    return splash_attention


def block_size(length: int) -> int:
    """The sequence tile for ``length`` (a multiple of ``attention_ops.KERNEL_BLOCK``)."""
    return next(block for block in BLOCKS if length % block == 0)


def splash_kernel(length_q: int, length_k: int, groups: int, left: int, right: int, interpret: bool = False,
                  save_residuals: bool = True):
    """The multi-query splash kernel for one key/value head and its ``groups`` query heads (made per trace:
    it holds its block maps as arrays of the trace that makes it); ``save_residuals``: it also returns the
    log-sum-exp, and cannot be differentiated by jax."""
    splash = _splash()
    shape = (length_q, length_k)
    if left < 0 and right < 0:
        mask = splash.FullMask(shape)
    elif left < 0 and right == 0:
        mask = splash.CausalMask(shape)
    else:
        mask = splash.LocalMask(shape, (left if left >= 0 else None, right if right >= 0 else None), offset=0)
    block_q, block_k = block_size(length_q), block_size(length_k)
    blocks = splash.BlockSizes(block_q=block_q, block_kv=block_k, block_kv_compute=block_k,
                               block_q_dkv=block_q, block_kv_dkv=block_k, block_kv_dkv_compute=block_k,
                               block_q_dq=block_q, block_kv_dq=block_k)
    return splash.make_splash_mqa_single_device(splash.MultiHeadMask([mask] * groups), block_sizes=blocks,
                                                save_residuals=save_residuals, interpret=interpret)


def _per_kv_head(tensor, kv_heads: int):
    """A query-shaped ``tensor`` as ``(batch, kv_heads, group, length, head_dim)``."""
    batch, heads, length, head_dim = tensor.shape
    return tensor.reshape(batch, kv_heads, heads // kv_heads, length, head_dim)


def _segments(kv_valid, length_q: int):
    import jax.numpy as jnp

    splash = _splash()
    if kv_valid is None:
        return None
    batch = kv_valid.shape[0]
    return splash.SegmentIds(q=jnp.ones((batch, length_q), jnp.int32), kv=kv_valid.astype(jnp.int32))


def _rows_seeing_a_key(kv_valid, length_q: int, left: int, right: int):
    """``(batch, 1, 1, length_q)``-broadcastable flags: whether each query row sees at least one valid key."""
    import jax.numpy as jnp

    counts = jnp.concatenate([jnp.zeros((kv_valid.shape[0], 1), jnp.int32),
                              jnp.cumsum(kv_valid.astype(jnp.int32), axis=1)], axis=1)
    length_k = kv_valid.shape[1]
    rows = jnp.arange(length_q)
    low = jnp.maximum(rows - left, 0) if left >= 0 else jnp.zeros_like(rows)
    high = jnp.minimum(rows + right + 1, length_k) if right >= 0 else jnp.full_like(rows, length_k)
    seen = jnp.take(counts, high, axis=1) - jnp.take(counts, low, axis=1)
    return (seen > 0)[:, None, :]


def _vmapped(fn, with_segments: bool, per_head: int = 0):
    """``fn(query, key, value, segments, *per_head_operands)`` over batch and key/value heads (segments per
    batch row only; ``per_head`` more operands laid out like the query)."""
    import jax

    segment_axis = 0 if with_segments else None
    inner = jax.vmap(fn, in_axes=(0, 0, 0, None) + (0,) * per_head)
    return jax.vmap(inner, in_axes=(0, 0, 0, segment_axis) + (0,) * per_head)


def _scaled(query, scale: float):
    """The query as the kernel takes it, scaled (a query the graph scaled already comes with scale 1)."""
    return query if scale == 1.0 else (query * scale).astype(query.dtype)


def splash_forward(query, key, value, kv_valid=None, *, left: int, right: int, scale: float,
                   interpret: bool = False):
    """``(out, lse)`` by jax's Pallas TPU splash-attention kernel."""
    import jax.numpy as jnp

    batch, heads, length_q, _ = query.shape
    kernel = splash_kernel(length_q, key.shape[2], heads // key.shape[1], left, right, interpret)

    def one_head(q, k, v, segments):
        out, (lse,) = kernel(q, k, v, segment_ids=segments)
        return out, lse

    scaled = _per_kv_head(_scaled(query, scale), key.shape[1])
    out, lse = _vmapped(one_head, kv_valid is not None)(scaled, key, value, _segments(kv_valid, length_q))
    out, lse = out.reshape(query.shape).astype(query.dtype), lse.reshape(batch, heads, length_q)
    if kv_valid is not None:
        seen = _rows_seeing_a_key(kv_valid, length_q, left, right)
        out = jnp.where(seen[..., None], out, jnp.zeros_like(out))
        lse = jnp.where(seen, lse, -jnp.inf)
    return out, lse.astype(jnp.float32)


def _private_backward():
    """jax's splash backward rule (``(..., residuals, grad_out)``), or None where its signature differs."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as module

    backward = getattr(module, "_splash_attention_bwd", None)
    expected = ["save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name",
                "mask_function", "attn_logits_soft_cap", "interpret", "res", "do"]
    if backward is None or list(inspect.signature(backward).parameters) != expected:
        return None
    return backward


def _collapsed(mask_info):
    if mask_info is None or mask_info.partial_mask_blocks is None:
        return mask_info
    blocks = mask_info.partial_mask_blocks
    return mask_info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


def splash_backward(grad_out, query, key, value, out, lse, kv_valid=None, *, left: int, right: int,
                    scale: float, interpret: bool = False):
    """Gradients of query, key and value by the splash kernel's backward passes, from the saved ``out`` and
    ``lse`` (rows that see no key: ``lse`` -inf here, +inf for the kernel, so their probabilities are 0)."""
    import jax
    import jax.numpy as jnp

    batch, heads, length_q, _ = query.shape
    kv_heads = key.shape[1]
    backward = _private_backward()
    kernel = splash_kernel(length_q, key.shape[2], heads // kv_heads, left, right, interpret,
                           save_residuals=backward is not None)
    scaled = _per_kv_head(_scaled(query, scale), kv_heads)
    segments = _segments(kv_valid, length_q)
    if backward is None:  # recompute the forward, through the kernel's own custom VJP
        def one_head(q, k, v, segment_ids, do):
            return jax.vjp(lambda q, k, v: kernel(q, k, v, segment_ids=segment_ids), q, k, v)[1](do)

        if kv_valid is not None:  # the forward zeroed rows that see no key: nothing flows back from them
            seen = _rows_seeing_a_key(kv_valid, length_q, left, right)
            grad_out = jnp.where(seen[..., None], grad_out, jnp.zeros_like(grad_out))
        per_head = (_per_kv_head(grad_out, kv_heads),)
    else:
        options = kernel.kwargs
        rule = functools.partial(
            backward, False, options["mask_value"], options["is_mqa"], options["block_sizes"],
            options["residual_checkpoint_name"], options["mask_function"], options["attn_logits_soft_cap"],
            options["interpret"])

        def one_head(q, k, v, segment_ids, do, o, row_lse):
            residuals = (q, k, v, segment_ids, None, o, row_lse, _collapsed(kernel.dq_mask_info),
                         _collapsed(kernel.dkv_mask_info))
            return rule(residuals, do)[3:6]

        saved_lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse).reshape(batch, kv_heads, -1, length_q)
        per_head = (_per_kv_head(grad_out, kv_heads), _per_kv_head(out, kv_heads), saved_lse)
    grad_query, grad_key, grad_value = _vmapped(one_head, segments is not None, len(per_head))(
        scaled, key, value, segments, *per_head)
    grad_query = grad_query.reshape(query.shape)
    if scale != 1.0:
        grad_query = grad_query.astype(jnp.float32) * scale
    return grad_query.astype(query.dtype), grad_key.astype(key.dtype), grad_value.astype(value.dtype)
