"""Ops whose result size depends on the values: ``nonzero``, ``masked_select``, ``unique`` and friends.

XLA compiles static shapes, so each op is lowered with its results padded to a bound known from the input
sizes (``numel`` for ``nonzero``, the size of the deduplicated dimension for ``unique``), and returns the
actual size as one more int64 scalar (see ``registry``). The driver compiles each such op as a region of its
own and the runtime cuts the padding off, so the user sees exactly eager's results. Padding is zeros.

The bodies are jax functions lowered through ``jax_bridge``: stable sorts with several keys, cumulative sums
and scatters are one line each there. Semantics follow PyTorch's CPU kernels: ``unique`` always sorts (its
``sorted=False`` returns sorted values on CPU too), rows compare lexicographically for ``dim=``, NaN is never
equal to NaN (each NaN is its own group, sorted last), and ``unique_consecutive`` groups equal neighbours
only.

PyTorch's traced graphs assert ``masked_select``'s size to be at most the input's ``numel``; when the mask
broadcasts the input to something larger, that assertion fails under ``torch.compile`` with any backend.
"""

from __future__ import annotations

import math

import torch
from jax.extend.mlir import ir

from tpucompile.lowering import builder, jax_bridge
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import TensorSpec

aten = torch.ops.aten
SIZE_SPEC = TensorSpec((), torch.int64)


def _call(ctx, name: str, fn, operands: list[ir.Value], params: tuple) -> list[ir.Value]:
    specs = [*ctx.avals_out, SIZE_SPEC]
    return jax_bridge.call(name, fn, operands, specs, params=params)


# --- nonzero and masked_select ------------------------------------------------------------------------------


def _compact(jnp, keep, values):
    """Move the rows of ``values`` where ``keep`` holds to the front (in order); zeros after; and the count."""
    size = keep.shape[0]
    target = jnp.where(keep, jnp.cumsum(keep) - 1, size)
    padded = jnp.zeros(values.shape, values.dtype).at[target].set(values, mode="drop")
    return padded, jnp.sum(keep, dtype=jnp.int64)


@register_rule(aten.nonzero.default, bound=lambda x: builder.numel(x.shape))
def _nonzero(ctx, x):
    shape = tuple(ctx.operand_metas[0].shape)
    rank = len(shape)

    def fn(x):
        import jax.numpy as jnp

        keep = x.reshape(-1) != 0
        positions = jnp.arange(keep.shape[0], dtype=jnp.int64)
        if rank:
            coordinates = jnp.stack(jnp.unravel_index(positions, x.shape), axis=1).astype(jnp.int64)
        else:
            coordinates = jnp.zeros((keep.shape[0], 0), jnp.int64)
        return _compact(jnp, keep, coordinates)

    return _call(ctx, "nonzero", fn, [x], params=(rank,))


def _broadcast_numel(x: TensorSpec, mask: TensorSpec) -> int:
    return builder.numel(torch.broadcast_shapes(x.shape, mask.shape))


@register_rule(aten.masked_select.default, bound=_broadcast_numel)
def _masked_select(ctx, x, mask):
    def fn(x, mask):
        import jax.numpy as jnp

        shape = jnp.broadcast_shapes(x.shape, mask.shape)
        keep = jnp.broadcast_to(mask, shape).reshape(-1)
        return _compact(jnp, keep, jnp.broadcast_to(x, shape).reshape(-1))

    return _call(ctx, "masked_select", fn, [x, mask], params=())


# --- unique ---------------------------------------------------------------------------------------------------


def _unique_rows(rows, *, sort: bool, want_inverse: bool, want_counts: bool):
    """Group equal rows of ``rows`` ([n, m]): first row of each group, inverse, counts, all padded to n."""
    import jax.numpy as jnp
    from jax import lax

    n, m = rows.shape
    if n == 0:
        empty = jnp.zeros((0,), jnp.int64)
        return rows, empty, empty, jnp.zeros((), jnp.int64)
    order = jnp.arange(n, dtype=jnp.int64)
    columns = [rows[:, j] for j in range(m)]
    if sort and m:
        *columns, order = lax.sort([*columns, order], num_keys=m, is_stable=True)
    differs = jnp.zeros((n - 1,), bool)
    for column in columns:
        differs = differs | (column[1:] != column[:-1])
    first = jnp.concatenate([jnp.ones((1,), bool), differs])
    group = jnp.cumsum(first, dtype=jnp.int64) - 1
    sorted_rows = rows[order]
    values = jnp.zeros_like(rows).at[jnp.where(first, group, n)].set(sorted_rows, mode="drop")
    inverse = jnp.zeros((n,), jnp.int64).at[order].set(group) if want_inverse else None
    counts = jnp.zeros((n,), jnp.int64).at[group].add(1) if want_counts else None
    return values, inverse, counts, group[-1] + 1


def _unique(ctx, x, *, dim: int | None, sort: bool, want_inverse: bool, want_counts: bool, name: str):
    meta = ctx.operand_metas[0]
    rank = meta.dim()
    dim = None if dim is None else dim % max(rank, 1)
    inverse_spec, counts_spec = ctx.avals_out[1], ctx.avals_out[2]

    def fn(x):
        import jax.numpy as jnp

        if dim is None:
            rows = x.reshape(-1, 1)
        else:
            moved = jnp.moveaxis(x, dim, 0)
            rows = moved.reshape(moved.shape[0], math.prod(moved.shape[1:]))
        values, inverse, counts, size = _unique_rows(
            rows, sort=sort, want_inverse=want_inverse, want_counts=want_counts
        )
        if dim is None:
            values = values.reshape(-1)
        else:
            values = jnp.moveaxis(values.reshape(moved.shape), 0, dim)
        inverse = inverse.reshape(inverse_spec.shape) if want_inverse else jnp.zeros(inverse_spec.shape, jnp.int64)
        counts = counts if want_counts else jnp.zeros(counts_spec.shape, jnp.int64)
        return values, inverse, counts, size

    return _call(ctx, name, fn, [x], params=(dim, sort, want_inverse, want_counts))


@register_rule(aten._unique2.default, bound=lambda x, *args, **kwargs: builder.numel(x.shape))
def _unique2(ctx, x, sorted=True, return_inverse=False, return_counts=False):
    return _unique(ctx, x, dim=None, sort=True, want_inverse=return_inverse, want_counts=return_counts,
                   name="unique")


@register_rule(aten.unique_dim.default, bound=lambda x, dim, *args, **kwargs: x.shape[dim])
def _unique_dim(ctx, x, dim, sorted=True, return_inverse=False, return_counts=False):
    return _unique(ctx, x, dim=dim, sort=True, want_inverse=return_inverse, want_counts=return_counts,
                   name="unique_dim")


def _unique_consecutive_bound(x: TensorSpec, return_inverse=False, return_counts=False, dim=None) -> int:
    return builder.numel(x.shape) if dim is None else x.shape[dim]


@register_rule(aten.unique_consecutive.default, bound=_unique_consecutive_bound)
def _unique_consecutive(ctx, x, return_inverse=False, return_counts=False, dim=None):
    return _unique(ctx, x, dim=dim, sort=False, want_inverse=return_inverse, want_counts=return_counts,
                   name="unique_consecutive")
