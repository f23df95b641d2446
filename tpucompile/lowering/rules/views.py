"""Views and shape manipulation. Values are immutable in StableHLO, so every view is a new value whose
shape the traced graph already knows (``ctx.aval_out``)."""

from __future__ import annotations

import torch
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.lowering import builder
from tpucompile.lowering.registry import register_lowering

aten = torch.ops.aten
prims = torch.ops.prims


@register_lowering(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.view_copy.default,
    prims.squeeze.default,
)
def _reshape(ctx, x, *args, **kwargs):
    return builder.reshape(x, ctx.aval_out.shape)


@register_lowering(aten.permute.default, aten.permute_copy.default)
def _permute(ctx, x, dims):
    rank = builder.rank_of(x)
    return builder.transpose(x, [d % rank if rank else 0 for d in dims])


@register_lowering(aten.t.default, aten.numpy_T.default)
def _t(ctx, x):
    rank = builder.rank_of(x)
    return builder.transpose(x, list(range(rank))[::-1])


@register_lowering(aten.transpose.int)
def _transpose(ctx, x, dim0, dim1):
    rank = builder.rank_of(x)
    if rank == 0:
        return x
    perm = list(range(rank))
    perm[dim0 % rank], perm[dim1 % rank] = perm[dim1 % rank], perm[dim0 % rank]
    return builder.transpose(x, perm)


@register_lowering(aten.expand.default, aten.expand_copy.default)
def _expand(ctx, x, size, implicit=False):
    return builder.broadcast_to(x, ctx.aval_out.shape)


def _normalize_range(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end


@register_lowering(aten.slice.Tensor, aten.slice_copy.Tensor)
def _slice(ctx, x, dim=0, start=None, end=None, step=1):
    shape = builder.shape_of(x)
    dim %= len(shape)
    lo, hi = _normalize_range(shape[dim], start, end)
    starts = [0] * len(shape)
    limits = list(shape)
    strides = [1] * len(shape)
    starts[dim], limits[dim], strides[dim] = lo, hi, step
    return builder.slice_static(x, starts, limits, strides)


@register_lowering(aten.select.int, aten.select_copy.int)
def _select(ctx, x, dim, index):
    shape = builder.shape_of(x)
    dim %= len(shape)
    index = index + shape[dim] if index < 0 else index
    starts = [0] * len(shape)
    limits = list(shape)
    starts[dim], limits[dim] = index, index + 1
    sliced = builder.slice_static(x, starts, limits, [1] * len(shape))
    return builder.reshape(sliced, ctx.aval_out.shape)


@register_lowering(aten.cat.default)
def _cat(ctx, tensors, dim=0):
    dtype = ctx.aval_out.dtype
    rank = ctx.aval_out.rank
    # torch.cat skips legacy 1-d empty tensors whatever the other inputs' rank.
    parts = [builder.convert(t, dtype) for t in tensors if builder.shape_of(t) != (0,) or rank == 1]
    if not parts:
        return builder.constant(0, dtype, ctx.aval_out.shape)
    return builder.concatenate(parts, dim % rank)


@register_lowering(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def _split_with_sizes(ctx, x, split_sizes, dim=0):
    return _split(x, list(split_sizes), dim)


@register_lowering(aten.split.Tensor, aten.split_copy.Tensor)
def _split_tensor(ctx, x, split_size, dim=0):
    size = builder.shape_of(x)[dim % builder.rank_of(x)]
    sizes = [min(split_size, size - start) for start in range(0, size, split_size)] if split_size else [size]
    return _split(x, sizes or [0], dim)


def _split(x, sizes: list[int], dim: int) -> list:
    shape = builder.shape_of(x)
    dim %= len(shape)
    outputs, offset = [], 0
    for size in sizes:
        starts = [0] * len(shape)
        limits = list(shape)
        starts[dim], limits[dim] = offset, offset + size
        outputs.append(builder.slice_static(x, starts, limits, [1] * len(shape)))
        offset += size
    return outputs


@register_lowering(aten.unbind.int)
def _unbind(ctx, x, dim=0):
    shape = builder.shape_of(x)
    dim %= len(shape)
    pieces = _split(x, [1] * shape[dim], dim)
    return [builder.reshape(p, shape[:dim] + shape[dim + 1 :]) for p in pieces]


@register_lowering(aten.flip.default)
def _flip(ctx, x, dims):
    rank = builder.rank_of(x)
    if not dims or rank == 0:
        return x
    return hlo.reverse(x, sorted(d % rank for d in dims))


@register_lowering(aten.constant_pad_nd.default)
def _constant_pad_nd(ctx, x, pad, value=0):
    rank = builder.rank_of(x)
    low, high = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):  # pad lists (left, right) pairs from the last dimension backwards
        dim = rank - 1 - i
        low[dim], high[dim] = pad[2 * i], pad[2 * i + 1]
    padding = builder.constant(value, builder.dtype_of(x), ())
    return hlo.pad(x, padding, low, high, [0] * rank)


@register_lowering(aten.repeat.default)
def _repeat(ctx, x, repeats):
    shape = builder.shape_of(x)
    shape = (1,) * (len(repeats) - len(shape)) + shape
    x = builder.reshape(x, shape)
    # Broadcast to [r0, s0, r1, s1, ...] then merge each pair: tiles follow each other, as in torch.
    expanded_shape = [d for pair in zip(repeats, shape, strict=True) for d in pair]
    dims = [2 * i + 1 for i in range(len(shape))]
    tiled = builder.broadcast_in_dims(x, expanded_shape, dims)
    return builder.reshape(tiled, ctx.aval_out.shape)
