"""Dense linear algebra.

Cholesky and triangular solves are StableHLO ops (``stablehlo.cholesky``, ``stablehlo.triangular_solve``)
and are written directly; everything built on an LU factorisation (inverse, solve, det, slogdet, lu_factor,
lu_solve, lu, lu_unpack) is taken from ``jax.lax.linalg`` through ``jax_bridge``.

PyTorch conventions kept: LU pivots are LAPACK's 1-based ``int32`` row swaps; ``info`` is 0, or ``i`` when
the i-th (1-based) pivot / leading minor fails; the unused triangle of a Cholesky factor is zero; batch dims
broadcast. Not kept: ``torch.linalg.inv``/``solve``/``cholesky`` raise on singular input in eager mode; a
compiled program cannot raise, so the ``_linalg_check_errors`` effect is dropped and the results are whatever
the factorisation gives (inf/NaN), with ``info`` still reported by the ``*_ex`` variants. A Cholesky factor
of a matrix that is not positive definite is all NaN (eager fills the columns before the failure).

Products and distances are StableHLO compositions: ``addbmm`` and ``_trilinear`` (``bilinear``) are
``dot_general``s; ``_cdist_forward``, ``_pdist_forward`` and ``dist`` compute p-norms of differences as
PyTorch's kernels do (``cdist`` with p = 2 takes the matrix-product form ``|x|^2 - 2 x.y + |y|^2`` where
PyTorch does: ``compute_mode`` 1, or 0 with more than 25 rows), and their backward kernels use PyTorch's per-p
formulas (zero where a distance is zero). Matrix factorisations (SVD, eigh, QR, LDL^T) are in ``factorizations.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder, jax_bridge
from tpucompile.lowering.registry import register_rule
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


@register_rule(aten.linalg_cholesky_ex.default)
def _linalg_cholesky_ex(ctx, a, *, upper=False, check_errors=False):
    if builder.numel(builder.shape_of(a)) == 0:
        return [builder.constant(0, spec.dtype, spec.shape) for spec in ctx.avals_out]
    fn = functools.partial(_jax_cholesky_info, upper=upper)
    info = jax_bridge.call("cholesky_info", fn, [a], [ctx.avals_out[1]], params=(upper,))[0]
    return _cholesky(a, upper), info


@register_rule(aten.cholesky.default)
def _cholesky_legacy(ctx, a, upper=False):
    return _cholesky(a, upper)


def _triangular_solve(a: Value, b: Value, *, left: bool, lower: bool, unit: bool, transpose: bool,
                      conjugate: bool = False) -> Value:
    """Solve with ``a``, its transpose, or (``conjugate``) its conjugate transpose."""
    batch = _batch_of(builder.shape_of(a), builder.shape_of(b))
    a, b = _broadcast_batch(a, batch), _broadcast_batch(b, batch)
    kind = "NO_TRANSPOSE" if not transpose else "ADJOINT" if conjugate else "TRANSPOSE"
    return hlo.triangular_solve(a, b, left, lower, unit, hlo.TransposeAttr.get(kind))


@register_rule(aten.linalg_solve_triangular.default)
def _linalg_solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    return _triangular_solve(a, b, left=left, lower=not upper, unit=unitriangular, transpose=False)


@register_rule(aten.triangular_solve.default)
def _legacy_triangular_solve(ctx, b, a, upper=True, transpose=False, unitriangular=False):
    solution = _triangular_solve(a, b, left=True, lower=not upper, unit=unitriangular, transpose=transpose)
    return solution, builder.broadcast_to(a, ctx.avals_out[1].shape)


@register_rule(aten.cholesky_solve.default)
def _cholesky_solve(ctx, b, factor, upper=False):
    # A = L L^H (or U^H U): solve with the factor, then with its conjugate transpose.
    y = _triangular_solve(factor, b, left=True, lower=not upper, unit=False, transpose=upper, conjugate=True)
    return _triangular_solve(factor, y, left=True, lower=not upper, unit=False, transpose=not upper,
                             conjugate=True)


@register_rule(aten.cholesky_inverse.default)
def _cholesky_inverse(ctx, factor, upper=False):
    eye = builder.eye(builder.shape_of(factor), builder.dtype_of(factor))
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


def _jax_lu_solve(lu, permutation, b, transpose: bool, conjugate: bool = True):
    """Solve ``A x = b`` (with ``transpose``: ``A^H x = b``, or ``A^T x = b`` without ``conjugate``) for
    ``A[permutation] = L U``; batch dims broadcast."""
    import jax.numpy as jnp
    from jax import lax

    batch = jnp.broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    lu = jnp.broadcast_to(lu, (*batch, *lu.shape[-2:]))
    permutation = jnp.broadcast_to(permutation, (*batch, permutation.shape[-1]))
    b = jnp.broadcast_to(b, (*batch, *b.shape[-2:]))
    rows = jnp.broadcast_to(permutation[..., :, None], b.shape)
    solve = functools.partial(lax.linalg.triangular_solve, left_side=True)
    if not transpose:
        x = jnp.take_along_axis(b, rows, axis=-2)
        x = solve(lu, x, lower=True, unit_diagonal=True)
        return solve(lu, x, lower=False)
    x = solve(lu, b, lower=False, transpose_a=True, conjugate_a=conjugate)
    x = solve(lu, x, lower=True, unit_diagonal=True, transpose_a=True, conjugate_a=conjugate)
    inverse = jnp.broadcast_to(jnp.argsort(permutation, axis=-1)[..., :, None], x.shape)
    return jnp.take_along_axis(x, inverse, axis=-2)


def _permutation_from_pivots(pivots, m: int):
    from jax import lax

    return lax.linalg.lu_pivots_to_permutation(pivots - 1, m)


def _jax_inv(a):
    import jax.numpy as jnp

    lu, _, info, permutation = _jax_lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _jax_lu_solve(lu, permutation, eye, transpose=False), info


def _empty_matrix_results(ctx, a, fills: tuple[float, ...]):
    """Results for 0x0 matrices, which LAPACK-style factorisations refuse: empty tensors stay empty, the
    scalar results take ``fills`` (det 1, sign 1, log|det| 0, info 0)."""
    if builder.shape_of(a)[-1] != 0:
        return None
    return [builder.constant(fill, spec.dtype, spec.shape) for spec, fill in zip(ctx.avals_out, fills, strict=True)]


@register_rule(aten.linalg_inv_ex.default)
def _linalg_inv_ex(ctx, a, *, check_errors=False):
    return _empty_matrix_results(ctx, a, (0, 0)) or jax_bridge.call("linalg_inv_ex", _jax_inv, [a], list(ctx.avals_out))


def _jax_lu_factor(a):
    lu, pivots, info, _ = _jax_lu(a)
    return lu, pivots, info


@register_rule(aten.linalg_lu_factor_ex.default)
def _linalg_lu_factor_ex(ctx, a, *, pivot=True, check_errors=False):
    if not pivot:
        raise UnsupportedOpError("linalg.lu_factor with pivot=False is not supported (nor by PyTorch on CPU)")
    return jax_bridge.call("linalg_lu_factor_ex", _jax_lu_factor, [a], list(ctx.avals_out))


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


@register_rule(aten.linalg_lu.default)
def _linalg_lu(ctx, a, *, pivot=True):
    if not pivot:
        raise UnsupportedOpError("linalg.lu with pivot=False is not supported (nor by PyTorch on CPU)")
    return jax_bridge.call("linalg_lu", _jax_linalg_lu, [a], list(ctx.avals_out))


def _jax_lu_unpack(lu, pivots):
    return _unpack(lu, _permutation_from_pivots(pivots, lu.shape[-2]), lu.dtype)


@register_rule(aten.lu_unpack.default)
def _lu_unpack(ctx, lu, pivots, unpack_data=True, unpack_pivots=True):
    specs = list(ctx.avals_out)
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
        return _jax_lu_solve(lu, permutation, b, transpose=adjoint)
    b = jnp.swapaxes(b, -1, -2)
    if adjoint:  # X A^H = B  <=>  conj(A) X^T = B^T  <=>  A conj(X^T) = conj(B^T)
        x = jnp.conj(_jax_lu_solve(lu, permutation, jnp.conj(b), transpose=False))
    else:  # X A = B  <=>  A^T X^T = B^T
        x = _jax_lu_solve(lu, permutation, b, transpose=True, conjugate=False)
    return jnp.swapaxes(x, -1, -2)


@register_rule(aten.linalg_lu_solve.default)
def _linalg_lu_solve(ctx, lu, pivots, b, *, left=True, adjoint=False):
    spec = ctx.aval_out
    if builder.numel(spec.shape) == 0:
        return builder.constant(0, spec.dtype, spec.shape)
    fn = functools.partial(_jax_lu_solve_op, left=left, adjoint=adjoint)
    return jax_bridge.call("linalg_lu_solve", fn, [lu, pivots, b], list(ctx.avals_out), params=(left, adjoint))[0]


def _jax_solve(a, b, left: bool, vector: bool):
    import jax.numpy as jnp

    lu, pivots, info, permutation = _jax_lu(a)
    if vector:
        b = b[..., None]
    if left:
        x = _jax_lu_solve(lu, permutation, b, transpose=False)
    else:  # X A = B  <=>  A^T X^T = B^T
        b = jnp.swapaxes(b, -1, -2)
        x = jnp.swapaxes(_jax_lu_solve(lu, permutation, b, transpose=True, conjugate=False), -1, -2)
    if vector:
        x = x[..., 0]
    return x, lu, pivots, info


def _is_vector_rhs(a_shape: Sequence[int], b_shape: Sequence[int]) -> bool:
    """PyTorch's rule: ``B`` is a (batch of) vector(s) if 1-d, or if its shape is ``A``'s without the last dim."""
    return len(b_shape) == 1 or (len(b_shape) == len(a_shape) - 1 and tuple(b_shape) == tuple(a_shape[:-1]))


@register_rule(aten._linalg_solve_ex.default)
def _linalg_solve_ex(ctx, a, b, *, left=True, check_errors=False):
    # The LU is of A, as eager's is (whatever A's layout): the backward graph solves with it through
    # linalg_lu_solve(..., adjoint=True), which gives A^-T only for the LU of A.
    x_spec, lu_spec, pivots_spec, info_spec = ctx.avals_out
    if builder.numel(x_spec.shape) == 0:
        # Nothing to solve for (no rows, no right-hand sides or an empty batch): still A's factorisation.
        if builder.numel(lu_spec.shape) == 0:
            return [builder.constant(0, spec.dtype, spec.shape) for spec in ctx.avals_out]
        a = builder.broadcast_to(a, lu_spec.shape)
        factors = jax_bridge.call("linalg_lu_factor_ex", _jax_lu_factor, [a], [lu_spec, pivots_spec, info_spec])
        return [builder.constant(0, x_spec.dtype, x_spec.shape), *factors]
    vector = _is_vector_rhs(builder.shape_of(a), builder.shape_of(b))
    fn = functools.partial(_jax_solve, left=left, vector=vector)
    return jax_bridge.call("linalg_solve_ex", fn, [a, b], list(ctx.avals_out), params=(left, vector))


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


@register_rule(aten._linalg_det.default)
def _linalg_det(ctx, a):
    transposed = _factors_transpose(ctx)
    fn = functools.partial(_jax_det, transposed=transposed)
    empty = _empty_matrix_results(ctx, a, (1, 0, 0))
    return empty or jax_bridge.call("linalg_det", fn, [a], list(ctx.avals_out), params=(transposed,))


@register_rule(aten._linalg_slogdet.default)
def _linalg_slogdet(ctx, a):
    transposed = _factors_transpose(ctx)
    fn = functools.partial(_jax_slogdet, transposed=transposed)
    empty = _empty_matrix_results(ctx, a, (1, 0, 0, 0))
    return empty or jax_bridge.call("linalg_slogdet", fn, [a], list(ctx.avals_out), params=(transposed,))


# --- the error-check effect ---------------------------------------------------------------------------------

_DROPPED_EFFECTS = {aten._linalg_check_errors.default}


@register_rule(torch.ops.higher_order.with_effects)
def _with_effects(ctx, token, op, *args, **kwargs):
    """``with_effects(token, op, ...)`` wraps ops with side effects. The only ones lowered are checks that
    raise in eager mode (``_linalg_check_errors``); a compiled program cannot raise, so they are dropped and
    the token passes through."""
    if op not in _DROPPED_EFFECTS:
        raise UnsupportedOpError(f"the side effect of {op} cannot be compiled")
    return [token] + [None] * (len(ctx.avals_out) - 1)


@register_rule(torch.ops.prims._make_token.default)
def _make_token(ctx):
    """The effect token AOTAutograd creates when it unlifts tokens from the graph: an empty tensor."""
    spec = ctx.aval_out
    return builder.constant(0, spec.dtype, spec.shape)


@register_rule(torch.ops.prims._sink_tokens.default)
def _sink_tokens(ctx, tokens):
    return None


# --- products and distances ---------------------------------------------------------------------------------


def _p_norm(diff: Value, p: float, dims: Sequence[int]) -> Value:
    """The p-norm of ``diff`` over ``dims``, as PyTorch's distance kernels compute it (p = 0 counts nonzeros);
    complex differences by their magnitudes."""
    if builder.dtype_of(diff).is_complex:
        diff = hlo.abs(diff)
    magnitude = hlo.abs(diff)
    if p == 0:
        nonzero = builder.compare(diff, builder.constant_like(0, diff), "NE")
        return builder.reduce_sum(builder.convert(nonzero, builder.dtype_of(diff)), dims)
    if p == 1:
        return builder.reduce_sum(magnitude, dims)
    if p == 2:
        return hlo.sqrt(builder.reduce_sum(hlo.multiply(diff, diff), dims))
    if p == float("inf"):
        return builder.reduce_max(magnitude, dims)
    if p == float("-inf"):
        return builder.reduce_min(magnitude, dims)
    total = builder.reduce_sum(hlo.power(magnitude, builder.constant_like(p, magnitude)), dims)
    return hlo.power(total, builder.constant_like(1.0 / p, total))


def _distance_grad(diff: Value, grad: Value, dist: Value, p: float) -> Value:
    """d dist / d x1 times the incoming gradient, elementwise (``diff = x1 - x2``; ``grad`` and ``dist`` broadcast
    along the vector dim): PyTorch's per-p backward formulas, zero where the distance is zero."""
    zero = builder.constant_like(0, diff)
    sign = hlo.sign(diff)
    if p == 0:
        return zero
    if p == 1:
        return hlo.multiply(sign, grad)
    at_zero = builder.compare(dist, builder.constant_like(0, dist), "EQ")
    if p == float("inf"):
        hit = builder.convert(builder.compare(hlo.abs(diff), dist, "EQ"), builder.dtype_of(diff))
        return hlo.multiply(hlo.multiply(grad, sign), hit)
    if p == 2:
        value = hlo.divide(hlo.multiply(grad, diff), dist)
    elif p < 2:
        scaled = hlo.multiply(hlo.multiply(sign, hlo.power(hlo.abs(diff), builder.constant_like(p - 1, diff))), grad)
        value = hlo.divide(scaled, hlo.power(dist, builder.constant_like(p - 1, dist)))
        if p < 1:
            at_zero = hlo.or_(at_zero, builder.compare(diff, zero, "EQ"))
    else:
        scaled = hlo.multiply(hlo.multiply(diff, hlo.power(hlo.abs(diff), builder.constant_like(p - 2, diff))), grad)
        value = hlo.divide(scaled, hlo.power(dist, builder.constant_like(p - 1, dist)))
    return builder.select(at_zero, zero, value)


def _pairwise_batch(x1: Value, x2: Value) -> tuple[Value, Value]:
    """Broadcast the batch dims of (..., r1, m) and (..., r2, m)."""
    batch = _batch_of(builder.shape_of(x1), builder.shape_of(x2))
    return _broadcast_batch(x1, batch), _broadcast_batch(x2, batch)


def _pairwise_diff(x1: Value, x2: Value) -> Value:
    """(..., r1, r2, m): x1[..., i, :] - x2[..., j, :]."""
    (*batch, r1, m), r2 = builder.shape_of(x1), builder.shape_of(x2)[-2]
    rank = len(batch)
    shape = (*batch, r1, r2, m)
    left = builder.broadcast_in_dims(x1, shape, [*range(rank), rank, rank + 2])
    right = builder.broadcast_in_dims(x2, shape, [*range(rank), rank + 1, rank + 2])
    return hlo.subtract(left, right)


def _euclidean_dist(x1: Value, x2: Value) -> Value:
    """PyTorch's matrix-product form: ``[-2 x1, |x1|^2, 1] @ [x2, 1, |x2|^2]^T``, clamped at 0, square-rooted."""
    shape1, shape2 = builder.shape_of(x1), builder.shape_of(x2)
    rank = len(shape1)
    norm1 = builder.reshape(builder.reduce_sum(hlo.multiply(x1, x1), [rank - 1]), (*shape1[:-1], 1))
    norm2 = builder.reshape(builder.reduce_sum(hlo.multiply(x2, x2), [rank - 1]), (*shape2[:-1], 1))
    minus_two_x1 = hlo.multiply(x1, builder.constant_like(-2, x1))
    left = builder.concatenate([minus_two_x1, norm1, builder.constant_like(1, norm1)], rank - 1)
    right = builder.concatenate([x2, builder.constant_like(1, norm2), norm2], rank - 1)
    batch = list(range(rank - 2))
    product = builder.dot_general(left, right, ([rank - 1], [rank - 1]), (batch, batch))
    return hlo.sqrt(hlo.maximum(product, builder.constant_like(0, product)))


def _uses_mm(p: float, mode: int | None, r1: int, r2: int) -> bool:
    return p == 2 and (mode == 1 or (mode in (None, 0) and (r1 > 25 or r2 > 25)))


@register_rule(aten._cdist_forward.default)
def _cdist_forward(ctx, x1, x2, p, compute_mode=None):
    spec = ctx.aval_out
    if 0 in spec.shape or builder.shape_of(x1)[-1] == 0:
        return builder.constant(0, spec.dtype, spec.shape)
    acc = builder.accumulator_dtype(spec.dtype)
    x1, x2 = _pairwise_batch(builder.convert(x1, acc), builder.convert(x2, acc))
    r1, r2 = builder.shape_of(x1)[-2], builder.shape_of(x2)[-2]
    if _uses_mm(p, compute_mode, r1, r2):
        result = _euclidean_dist(x1, x2)
    else:
        diff = _pairwise_diff(x1, x2)
        result = _p_norm(diff, p, [builder.rank_of(diff) - 1])
    return builder.convert(result, spec.dtype)


@register_rule(aten._cdist_backward.default)
def _cdist_backward(ctx, grad, x1, x2, p, cdist):
    """The gradient for x1, with the batch dims of the broadcast (as PyTorch's kernel returns it)."""
    spec = ctx.aval_out
    if builder.numel(spec.shape) == 0 or builder.numel(builder.shape_of(x2)) == 0:
        return builder.constant(0, spec.dtype, spec.shape)
    acc = builder.accumulator_dtype(spec.dtype)
    x1, x2 = _pairwise_batch(builder.convert(x1, acc), builder.convert(x2, acc))
    diff = _pairwise_diff(x1, x2)
    shape = builder.shape_of(diff)
    rank = len(shape)
    along = [*range(rank - 1)]
    grad = builder.broadcast_in_dims(builder.convert(grad, acc), shape, along)
    dist = builder.broadcast_in_dims(builder.convert(cdist, acc), shape, along)
    result = builder.reduce_sum(_distance_grad(diff, grad, dist, p), [rank - 2])
    return builder.convert(builder.broadcast_to(result, spec.shape), spec.dtype)


def _upper_pairs(n: int) -> tuple[Value, Value]:
    """Constant row indices (i, j), i < j in row-major order, as (K, 1) int64 index tensors."""
    rows, cols = torch.triu_indices(n, n, offset=1)
    return builder.dense_constant(rows.reshape(-1, 1)), builder.dense_constant(cols.reshape(-1, 1))


def _take_rows(x: Value, indices: Value) -> Value:
    shape = builder.shape_of(x)
    numbers = hlo.GatherDimensionNumbers.get(
        offset_dims=[1],
        collapsed_slice_dims=[0],
        operand_batching_dims=[],
        start_indices_batching_dims=[],
        start_index_map=[0],
        index_vector_dim=1,
    )
    return hlo.gather(x, indices, numbers, [1, shape[1]])


@register_rule(aten._pdist_forward.default)
def _pdist_forward(ctx, x, p=2.0):
    spec = ctx.aval_out
    n, m = builder.shape_of(x)
    if spec.shape[0] == 0 or m == 0:
        return builder.constant(0, spec.dtype, spec.shape)
    x = builder.convert(x, builder.accumulator_dtype(spec.dtype))
    first, second = _upper_pairs(n)
    diff = hlo.subtract(_take_rows(x, first), _take_rows(x, second))
    return builder.convert(_p_norm(diff, p, [1]), spec.dtype)


@register_rule(aten._pdist_backward.default)
def _pdist_backward(ctx, grad, x, p, pdist):
    spec = ctx.aval_out
    n, m = builder.shape_of(x)
    pairs = builder.shape_of(pdist)[0]
    if pairs == 0 or m == 0:
        return builder.constant(0, spec.dtype, spec.shape)
    acc = builder.accumulator_dtype(spec.dtype)
    x = builder.convert(x, acc)
    first, second = _upper_pairs(n)
    diff = hlo.subtract(_take_rows(x, first), _take_rows(x, second))
    shape = builder.shape_of(diff)
    grad = builder.broadcast_in_dims(builder.convert(grad, acc), shape, [0])
    dist = builder.broadcast_in_dims(builder.convert(pdist, acc), shape, [0])
    contribution = _distance_grad(diff, grad, dist, p)
    result = builder.scatter_rows(builder.constant(0, acc, (n, m)), first, contribution, hlo.add)
    result = builder.scatter_rows(result, second, hlo.negate(contribution), hlo.add)
    return builder.convert(result, spec.dtype)


@register_rule(aten.dist.default)
def _dist(ctx, a, b, p=2):
    spec = ctx.aval_out
    acc = builder.accumulator_dtype(spec.dtype)
    promoted = torch.promote_types(builder.dtype_of(a), builder.dtype_of(b))
    if promoted.is_complex:
        acc = promoted  # the norm of complex differences is real: subtract as complex
    a, b = builder.convert(a, acc), builder.convert(b, acc)
    shape = tuple(torch.broadcast_shapes(builder.shape_of(a), builder.shape_of(b)))
    diff = hlo.subtract(builder.broadcast_to(a, shape), builder.broadcast_to(b, shape))
    flat = builder.reshape(diff, (builder.numel(shape),))
    return builder.convert(builder.reshape(_p_norm(flat, float(p), [0]), spec.shape), spec.dtype)


@register_rule(aten.addbmm.default)
def _addbmm(ctx, bias, batch1, batch2, *, beta=1, alpha=1):
    """``beta * bias + alpha * sum_b batch1[b] @ batch2[b]``; beta == 0 ignores bias (even NaN)."""
    spec = ctx.aval_out
    acc = builder.accumulator_dtype(spec.dtype)
    lhs, rhs = builder.convert(batch1, spec.dtype), builder.convert(batch2, spec.dtype)
    result = builder.scaled(builder.dot_general(lhs, rhs, ([0, 2], [0, 1]), out_dtype=acc), alpha)
    if beta != 0:
        bias = builder.broadcast_to(builder.convert(bias, acc), spec.shape)
        result = hlo.add(builder.scaled(bias, beta), result)
    return builder.convert(result, spec.dtype)


def _contract(a: Value, a_dims: list[int], b: Value, b_dims: list[int], summed: set[int]):
    """Multiply two tensors whose axes carry the labels ``a_dims``/``b_dims`` (broadcasting shared labels) and
    sum out the labels in ``summed``; returns the product and its labels (batch, then a's, then b's)."""
    a, a_dims = _sum_labels(a, a_dims, summed - set(b_dims))
    b, b_dims = _sum_labels(b, b_dims, summed - set(a_dims))
    shared = [d for d in a_dims if d in b_dims]
    a_shape, b_shape = builder.shape_of(a), builder.shape_of(b)
    sizes = {d: max(a_shape[a_dims.index(d)], b_shape[b_dims.index(d)]) for d in shared}
    a = builder.broadcast_to(a, [sizes.get(d, s) for d, s in zip(a_dims, a_shape, strict=True)])
    b = builder.broadcast_to(b, [sizes.get(d, s) for d, s in zip(b_dims, b_shape, strict=True)])
    batch = [d for d in shared if d not in summed]
    contracting = [d for d in shared if d in summed]
    product = builder.dot_general(
        a, b,
        ([a_dims.index(d) for d in contracting], [b_dims.index(d) for d in contracting]),
        ([a_dims.index(d) for d in batch], [b_dims.index(d) for d in batch]),
    )
    labels = batch + [d for d in a_dims if d not in shared] + [d for d in b_dims if d not in shared]
    return product, labels


def _sum_labels(x: Value, labels: list[int], summed: set[int]):
    axes = [i for i, d in enumerate(labels) if d in summed]
    return builder.reduce_sum(x, axes), [d for d in labels if d not in summed]


@register_rule(aten._trilinear.default)
def _trilinear(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``(i1 * i2 * i3).sum(sumdim)`` after unsqueezing each input at its ``expand`` dims, as two contractions:
    first i1 with i2 over the summed dims i3 lacks, then with i3 over the rest."""
    spec = ctx.aval_out
    acc = builder.accumulator_dtype(spec.dtype)
    total = builder.rank_of(i1) + len(expand1)
    sums = {d % total for d in sumdim}

    def labelled(x, expand):
        missing = {d % total for d in expand}
        return builder.convert(x, acc), [d for d in range(total) if d not in missing]

    (a, la), (b, lb), (c, lc) = labelled(i1, expand1), labelled(i2, expand2), labelled(i3, expand3)
    product, labels = _contract(a, la, b, lb, {d for d in sums if d not in lc})
    product, labels = _contract(product, labels, c, lc, sums)
    product = builder.transpose(product, [labels.index(d) for d in sorted(labels)])
    return builder.convert(builder.reshape(product, spec.shape), spec.dtype)
