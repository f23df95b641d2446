"""Dense linear algebra.

Cholesky and triangular solves are StableHLO ops (``stablehlo.cholesky``, ``stablehlo.triangular_solve``)
and are written directly; everything built on an LU factorisation (inverse, solve, det, slogdet, lu_factor,
lu_solve, lu, lu_unpack) is taken from ``jax.lax.linalg`` through ``jax_bridge`` (DESIGN decision 1).

PyTorch conventions kept: LU pivots are LAPACK's 1-based ``int32`` row swaps; ``info`` is 0, or ``i`` when
the i-th (1-based) pivot / leading minor fails; the unused triangle of a Cholesky factor is zero; batch dims
broadcast. Not kept: ``torch.linalg.inv``/``solve``/``cholesky`` raise on singular input in eager mode; a
compiled program cannot raise, so the ``_linalg_check_errors`` effect is dropped and the results are whatever
the factorisation gives (inf/NaN), with ``info`` still reported by the ``*_ex`` variants. A Cholesky factor
of a matrix that is not positive definite is all NaN (eager fills the columns before the failure).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder, jax_bridge
from tpucompile.lowering.registry import register_lowering
from tpucompile.lowering.types import TensorSpec

aten = torch.ops.aten
Value = ir.Value


# --- native StableHLO ---------------------------------------------------------------------------------------


def _triangle(x: Value, lower: bool) -> Value:
    """Zero everything outside the lower or upper triangle (diagonal included) of the last two dims."""
    shape = builder.shape_of(x)
    rank = len(shape)
    rows = builder.iota(shape, torch.int64, rank - 2)
    cols = builder.iota(shape, torch.int64, rank - 1)
    keep = builder.compare(rows, cols, "GE" if lower else "LE")
    return builder.select(keep, x, builder.constant(0, builder.dtype_of(x), shape))


def _broadcast_batch(x: Value, batch: Sequence[int]) -> Value:
    shape = builder.shape_of(x)
    return builder.broadcast_to(x, (*batch, *shape[-2:]))


def _batch_of(*shapes: Sequence[int]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(torch.Size(s[:-2]) for s in shapes)))


def _cholesky(a: Value, upper: bool) -> Value:
    factor = hlo.cholesky(a, lower=not upper)
    return _triangle(factor, lower=not upper)


def _jax_cholesky_info(a, upper: bool):
    """LAPACK's ``potrf`` info: the order of the first leading minor that is not positive definite, or 0.

    XLA's Cholesky turns the whole factor into NaN on failure, so the order is found separately by the
    unblocked elimination, whose k-th pivot is the k-th leading minor over the one before it; it only runs
    when the info result is used (XLA drops it otherwise).
    """
    import jax.numpy as jnp
    from jax import lax

    n = a.shape[-1]
    triangle = jnp.triu(a) if upper else jnp.tril(a)
    matrix = triangle + jnp.swapaxes(jnp.triu(a, 1) if upper else jnp.tril(a, -1), -1, -2)
    positions = jnp.arange(n)

    def step(k, state):
        m, info = state
        pivot = m[..., k, k]
        failed = jnp.logical_not(pivot > 0)
        info = jnp.where((info == 0) & failed, k + 1, info)
        column = jnp.where(positions > k, m[..., :, k], 0) / jnp.sqrt(jnp.where(failed, 1, pivot))[..., None]
        return m - column[..., :, None] * column[..., None, :], info

    info = jnp.zeros(a.shape[:-2], dtype=jnp.int32)
    return lax.fori_loop(0, n, step, (matrix, info))[1]


@register_lowering(aten.linalg_cholesky_ex.default)
def _linalg_cholesky_ex(ctx, a, *, upper=False, check_errors=False):
    fn = functools.partial(_jax_cholesky_info, upper=upper)
    info = jax_bridge.call("cholesky_info", fn, [a], [ctx.avals_out[1]], params=(upper,))[0]
    return _cholesky(a, upper), info


@register_lowering(aten.cholesky.default)
def _cholesky_legacy(ctx, a, upper=False):
    return _cholesky(a, upper)


def _triangular_solve(a: Value, b: Value, *, left: bool, lower: bool, unit: bool, transpose: bool) -> Value:
    batch = _batch_of(builder.shape_of(a), builder.shape_of(b))
    a, b = _broadcast_batch(a, batch), _broadcast_batch(b, batch)
    return hlo.triangular_solve(
        a, b, left, lower, unit, hlo.TransposeAttr.get("TRANSPOSE" if transpose else "NO_TRANSPOSE")
    )


@register_lowering(aten.linalg_solve_triangular.default)
def _linalg_solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    return _triangular_solve(a, b, left=left, lower=not upper, unit=unitriangular, transpose=False)


@register_lowering(aten.triangular_solve.default)
def _legacy_triangular_solve(ctx, b, a, upper=True, transpose=False, unitriangular=False):
    solution = _triangular_solve(a, b, left=True, lower=not upper, unit=unitriangular, transpose=transpose)
    return solution, builder.broadcast_to(a, ctx.avals_out[1].shape)


@register_lowering(aten.cholesky_solve.default)
def _cholesky_solve(ctx, b, factor, upper=False):
    # A = L L^T (or U^T U): solve with the factor, then with its transpose.
    y = _triangular_solve(factor, b, left=True, lower=not upper, unit=False, transpose=upper)
    return _triangular_solve(factor, y, left=True, lower=not upper, unit=False, transpose=not upper)


@register_lowering(aten.cholesky_inverse.default)
def _cholesky_inverse(ctx, factor, upper=False):
    shape = builder.shape_of(factor)
    rank = len(shape)
    eye = builder.convert(
        builder.compare(builder.iota(shape, torch.int64, rank - 2), builder.iota(shape, torch.int64, rank - 1), "EQ"),
        builder.dtype_of(factor),
    )
    return _cholesky_solve(ctx, eye, factor, upper)


# --- from jax: LU and what is built on it --------------------------------------------------------------------


def _jax_lu(a):
    """(lu, 1-based int32 pivots, int32 info, 0-based permutation) of ``a`` with partial pivoting."""
    import jax.numpy as jnp
    from jax import lax

    lu, pivots, permutation = lax.linalg.lu(a)
    k = min(a.shape[-2:])
    diagonal = jnp.diagonal(lu[..., :k, :k], axis1=-2, axis2=-1)
    singular = diagonal == 0
    info = jnp.where(jnp.any(singular, axis=-1), jnp.argmax(singular, axis=-1) + 1, 0).astype(jnp.int32)
    return lu, (pivots + 1).astype(jnp.int32), info, permutation


def _jax_lu_solve(lu, permutation, b, adjoint: bool):
    """Solve ``A x = b`` (``A^T x = b`` with ``adjoint``) for ``A[permutation] = L U``; batch dims broadcast."""
    import jax.numpy as jnp
    from jax import lax

    batch = jnp.broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    lu = jnp.broadcast_to(lu, (*batch, *lu.shape[-2:]))
    permutation = jnp.broadcast_to(permutation, (*batch, permutation.shape[-1]))
    b = jnp.broadcast_to(b, (*batch, *b.shape[-2:]))
    rows = jnp.broadcast_to(permutation[..., :, None], b.shape)
    solve = functools.partial(lax.linalg.triangular_solve, left_side=True)
    if not adjoint:
        x = jnp.take_along_axis(b, rows, axis=-2)
        x = solve(lu, x, lower=True, unit_diagonal=True)
        return solve(lu, x, lower=False)
    x = solve(lu, b, lower=False, transpose_a=True)
    x = solve(lu, x, lower=True, unit_diagonal=True, transpose_a=True)
    inverse = jnp.broadcast_to(jnp.argsort(permutation, axis=-1)[..., :, None], x.shape)
    return jnp.take_along_axis(x, inverse, axis=-2)


def _permutation_from_pivots(pivots, m: int):
    from jax import lax

    return lax.linalg.lu_pivots_to_permutation(pivots - 1, m)


def _specs(ctx) -> list[TensorSpec]:
    return list(ctx.avals_out)


def _jax_inv(a):
    import jax.numpy as jnp

    lu, _, info, permutation = _jax_lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _jax_lu_solve(lu, permutation, eye, adjoint=False), info


def _empty_matrix_results(ctx, a, fills: tuple[float, ...]):
    """Results for 0x0 matrices, which LAPACK-style factorisations refuse: empty tensors stay empty, the
    scalar results take ``fills`` (det 1, sign 1, log|det| 0, info 0)."""
    if builder.shape_of(a)[-1] != 0:
        return None
    return [builder.constant(fill, spec.dtype, spec.shape) for spec, fill in zip(ctx.avals_out, fills, strict=True)]


@register_lowering(aten.linalg_inv_ex.default)
def _linalg_inv_ex(ctx, a, *, check_errors=False):
    return _empty_matrix_results(ctx, a, (0, 0)) or jax_bridge.call("linalg_inv_ex", _jax_inv, [a], _specs(ctx))


def _jax_lu_factor(a):
    lu, pivots, info, _ = _jax_lu(a)
    return lu, pivots, info


@register_lowering(aten.linalg_lu_factor_ex.default)
def _linalg_lu_factor_ex(ctx, a, *, pivot=True, check_errors=False):
    if not pivot:
        raise UnsupportedOpError("linalg.lu_factor with pivot=False is not supported (nor by PyTorch on CPU)")
    return jax_bridge.call("linalg_lu_factor_ex", _jax_lu_factor, [a], _specs(ctx))


def _unpack(lu, permutation, dtype):
    """(P, L, U) with ``A = P L U`` from a packed LU and its row permutation."""
    import jax.numpy as jnp

    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    rows = (permutation[..., :, None] == jnp.arange(m)).astype(dtype)  # P^T: row i is e_{perm[i]}
    return jnp.swapaxes(rows, -1, -2), lower, upper


def _jax_linalg_lu(a):
    lu, _, _, permutation = _jax_lu(a)
    return _unpack(lu, permutation, a.dtype)


@register_lowering(aten.linalg_lu.default)
def _linalg_lu(ctx, a, *, pivot=True):
    if not pivot:
        raise UnsupportedOpError("linalg.lu with pivot=False is not supported (nor by PyTorch on CPU)")
    return jax_bridge.call("linalg_lu", _jax_linalg_lu, [a], _specs(ctx))


def _jax_lu_unpack(lu, pivots):
    return _unpack(lu, _permutation_from_pivots(pivots, lu.shape[-2]), lu.dtype)


@register_lowering(aten.lu_unpack.default)
def _lu_unpack(ctx, lu, pivots, unpack_data=True, unpack_pivots=True):
    specs = _specs(ctx)
    m, n = builder.shape_of(lu)[-2:]
    k = min(m, n)
    batch = builder.shape_of(lu)[:-2]
    dtype = builder.dtype_of(lu)
    wanted = [TensorSpec((*batch, m, m), dtype), TensorSpec((*batch, m, k), dtype), TensorSpec((*batch, k, n), dtype)]
    results = jax_bridge.call("lu_unpack", _jax_lu_unpack, [lu, pivots], wanted)
    # Parts not asked for are empty tensors in PyTorch.
    return [
        value if spec.shape == want.shape else builder.constant(0, spec.dtype, spec.shape)
        for value, spec, want in zip(results, specs, wanted, strict=True)
    ]


def _jax_lu_solve_op(lu, pivots, b, left: bool, adjoint: bool):
    import jax.numpy as jnp

    permutation = _permutation_from_pivots(pivots, lu.shape[-1])
    if left:
        return _jax_lu_solve(lu, permutation, b, adjoint)
    # X A = B  <=>  A^T X^T = B^T
    x = _jax_lu_solve(lu, permutation, jnp.swapaxes(b, -1, -2), not adjoint)
    return jnp.swapaxes(x, -1, -2)


@register_lowering(aten.linalg_lu_solve.default)
def _linalg_lu_solve(ctx, lu, pivots, b, *, left=True, adjoint=False):
    fn = functools.partial(_jax_lu_solve_op, left=left, adjoint=adjoint)
    return jax_bridge.call("linalg_lu_solve", fn, [lu, pivots, b], _specs(ctx), params=(left, adjoint))[0]


def _jax_solve(a, b, left: bool, vector: bool):
    import jax.numpy as jnp

    lu, pivots, info, permutation = _jax_lu(a)
    if vector:
        b = b[..., None]
    if left:
        x = _jax_lu_solve(lu, permutation, b, adjoint=False)
    else:
        x = jnp.swapaxes(_jax_lu_solve(lu, permutation, jnp.swapaxes(b, -1, -2), adjoint=True), -1, -2)
    if vector:
        x = x[..., 0]
    return x, lu, pivots, info


def _is_vector_rhs(a_shape: Sequence[int], b_shape: Sequence[int]) -> bool:
    """PyTorch's rule: ``B`` is a (batch of) vector(s) if 1-d, or if its shape is ``A``'s without the last dim."""
    return len(b_shape) == 1 or (len(b_shape) == len(a_shape) - 1 and tuple(b_shape) == tuple(a_shape[:-1]))


@register_lowering(aten._linalg_solve_ex.default)
def _linalg_solve_ex(ctx, a, b, *, left=True, check_errors=False):
    # The LU is of A, as eager's is (whatever A's layout): the backward graph solves with it through
    # linalg_lu_solve(..., adjoint=True), which gives A^-T only for the LU of A.
    vector = _is_vector_rhs(builder.shape_of(a), builder.shape_of(b))
    fn = functools.partial(_jax_solve, left=left, vector=vector)
    return jax_bridge.call("linalg_solve_ex", fn, [a, b], _specs(ctx), params=(left, vector))


def _jax_det_parts(a, transposed: bool):
    import jax.numpy as jnp

    lu, pivots, _, _ = _jax_lu(jnp.swapaxes(a, -1, -2) if transposed else a)
    n = a.shape[-1]
    diagonal = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(pivots != jnp.arange(1, n + 1, dtype=pivots.dtype), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(a.dtype)
    return lu, pivots, diagonal, parity


def _jax_det(a, transposed: bool):
    import jax.numpy as jnp

    lu, pivots, diagonal, parity = _jax_det_parts(a, transposed)
    return parity * jnp.prod(diagonal, axis=-1), lu, pivots


def _jax_slogdet(a, transposed: bool):
    import jax.numpy as jnp

    lu, pivots, diagonal, parity = _jax_det_parts(a, transposed)
    sign = parity * jnp.prod(jnp.sign(diagonal), axis=-1)
    logabsdet = jnp.sum(jnp.log(jnp.abs(diagonal)), axis=-1)
    return sign, logabsdet, lu, pivots


def _factors_transpose(ctx) -> bool:
    """Eager ``_linalg_det``/``_linalg_slogdet`` factor ``A^T`` when ``A`` is contiguous, and the backward
    graph traced from them solves with that LU accordingly; follow the traced operand's layout."""
    meta = ctx.operand_metas[0]
    return bool(isinstance(meta, torch.Tensor) and meta.is_contiguous())


@register_lowering(aten._linalg_det.default)
def _linalg_det(ctx, a):
    transposed = _factors_transpose(ctx)
    fn = functools.partial(_jax_det, transposed=transposed)
    empty = _empty_matrix_results(ctx, a, (1, 0, 0))
    return empty or jax_bridge.call("linalg_det", fn, [a], _specs(ctx), params=(transposed,))


@register_lowering(aten._linalg_slogdet.default)
def _linalg_slogdet(ctx, a):
    transposed = _factors_transpose(ctx)
    fn = functools.partial(_jax_slogdet, transposed=transposed)
    empty = _empty_matrix_results(ctx, a, (1, 0, 0, 0))
    return empty or jax_bridge.call("linalg_slogdet", fn, [a], _specs(ctx), params=(transposed,))


# --- the error-check effect ---------------------------------------------------------------------------------

_DROPPED_EFFECTS = {aten._linalg_check_errors.default}


@register_lowering(torch.ops.higher_order.with_effects)
def _with_effects(ctx, token, op, *args, **kwargs):
    """``with_effects(token, op, ...)`` wraps ops with side effects. The only ones lowered are checks that
    raise in eager mode (``_linalg_check_errors``); a compiled program cannot raise, so they are dropped and
    the token passes through."""
    if op not in _DROPPED_EFFECTS:
        raise UnsupportedOpError(f"the side effect of {op} cannot be compiled")
    return [token] + [None] * (len(ctx.avals_out) - 1)


@register_lowering(torch.ops.prims._make_token.default)
def _make_token(ctx):
    """The effect token AOTAutograd creates when it unlifts tokens from the graph: an empty tensor."""
    spec = ctx.aval_out
    return builder.constant(0, spec.dtype, spec.shape)


@register_lowering(torch.ops.prims._sink_tokens.default)
def _sink_tokens(ctx, tokens):
    return None
