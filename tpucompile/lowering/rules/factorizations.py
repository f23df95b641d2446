"""Matrix factorisations: SVD, symmetric eigendecomposition, QR and Householder products, LDL^T (Bunch-Kaufman);
also the pseudo-inverse and the matrix exponential.

All are jax functions spliced in through ``jax_bridge``: ``jax.numpy.linalg``,
``jax.lax.linalg`` and ``jax.scipy.linalg`` where they have the routine (SVD, eigh, QR, ``orgqr``, ``expm``),
and small jax loops written here, after the LAPACK routines PyTorch calls, where they do not or where PyTorch's
result depends on how the routine computes it (``geqr2``, ``gebd2``, ``sytd2``, ``steqr``, ``sytf2``, ``sytrs``).

Conventions kept where the result is unique: singular values descending, eigenvalues ascending, the Q/R of
``reduced``/``complete``/``r`` modes, ``geqrf``'s reflectors and taus, LDL pivots in LAPACK's 1-based ``int32``
form (negative for 2x2 blocks) with the unused triangle of ``LD`` zero, identity factors for matrices with a
zero dimension. ``_linalg_check_errors`` is dropped as in ``linalg.py``: no error is raised for singular input.

Where it is not unique (the signs of singular vectors and eigenvectors), the vectors are computed the way
PyTorch's CPU build (MKL) computes them, which differs from the reference LAPACK that jax calls on CPU:

* ``gesdd`` chooses between bidiagonalising A directly and QR- (LQ-) factoring it first by the aspect ratio.
  Reference LAPACK factors once ``max(m, n) >= int(11 min(m, n) / 6)``; MKL factors a tall matrix from
  ``m >= n + n // 2`` on and a wide one never (thresholds found by experiment). Where they differ we take
  MKL's path: for tall matrices a QR factorisation and the SVD of R; for wide ones the direct path
  ("path 5t"): Householder bidiagonalisation as ``sgebd2`` does it (lower bidiagonal), the Givens rotations
  that ``sbdsdc`` applies to make it upper bidiagonal, and the SVD of that upper bidiagonal matrix from
  ``gesdd`` (where reference LAPACK and MKL agree, and whose own bidiagonalisation is then the identity).
* ``syevd`` of a matrix of order 2..25 runs ``sytrd`` and then ``ssteqr`` (larger ones divide and conquer,
  where MKL and reference LAPACK agree and jax's eigh is used). MKL's ``ssteqr`` is the reference iteration
  with LAPACK's pre-3.10 ``slartg``; ``_steqr`` reproduces it. The signs that QL/QR iteration leaves on the
  eigenvectors hinge, for some matrices, on the rounding of nearly cancelling quantities, so they can still
  differ from eager's where the float32 arithmetic differs (rarely for small matrices, more often for larger
  ones; far more often with reference LAPACK's conventions).
"""

from __future__ import annotations

import functools
import math

import torch
from jax.extend.mlir import ir

from tpucompile.lowering import builder, jax_bridge
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import TensorSpec

aten = torch.ops.aten
Value = ir.Value


# --- shared ---------------------------------------------------------------------------------------------------


def _zeros(spec: TensorSpec) -> Value:
    return builder.constant(0, spec.dtype, spec.shape)


def _identity_or_zeros(spec: TensorSpec | None) -> Value | None:
    """A factor of a matrix without entries, as PyTorch gives it: the identity where the factor has entries
    (a complete Q or U of a matrix with no columns, a complete Vh of one with no rows), else empty."""
    if spec is None:
        return None
    if builder.numel(spec.shape) == 0 or len(spec.shape) < 2:
        return _zeros(spec)
    return builder.eye(spec.shape, spec.dtype)


def _batched(fn, *arrays, core_ranks):
    """Apply a one-matrix jax function over the flattened (equal) batch dims of its operands; without a batch
    to map over, its loops stay unbatched."""
    import jax

    batch = arrays[0].shape[: arrays[0].ndim - core_ranks[0]]
    count = math.prod(batch)
    flat = [x.reshape((count, *x.shape[x.ndim - r:])) for x, r in zip(arrays, core_ranks, strict=True)]
    if count == 1:
        results = [r[None] for r in fn(*(x[0] for x in flat))]
    else:
        results = jax.vmap(fn)(*flat)
    return tuple(r.reshape((*batch, *r.shape[1:])) for r in results)


# --- jax helpers: LAPACK's elementary reflectors and rotations ----------------------------------------------------


def _larfg(alpha, tail_norm):
    """LAPACK ``slarfg``: (beta, tau, scale) with ``H [alpha; x] = [beta; 0]``, ``v = [1; x * scale]``.

    ``beta = -sign(alpha) * ||[alpha; x]||``; ``tau = 0`` (H = I, beta = alpha) when ``x`` is zero.
    """
    import jax.numpy as jnp

    norm = jnp.hypot(alpha, tail_norm)
    beta = -jnp.where(alpha >= 0, norm, -norm)
    reflect = tail_norm != 0
    safe_beta = jnp.where(reflect, beta, 1)
    tau = jnp.where(reflect, (beta - alpha) / safe_beta, 0)
    scale = jnp.where(reflect, 1 / jnp.where(reflect, alpha - beta, 1), 0)
    return jnp.where(reflect, beta, alpha), tau, scale


def _larfg_complex(alpha, tail_norm):
    """LAPACK ``clarfg``: as ``_larfg`` for a complex column, ``H^H [alpha; x] = [beta; 0]`` with ``beta`` real,
    so ``H = I - tau v v^H`` reflects whenever ``x`` is nonzero or ``alpha`` is not real."""
    import jax.numpy as jnp

    real, imaginary = jnp.real(alpha), jnp.imag(alpha)
    norm = jnp.sqrt(real * real + imaginary * imaginary + tail_norm * tail_norm)
    beta = -jnp.where(real >= 0, norm, -norm)
    reflect = (tail_norm != 0) | (imaginary != 0)
    safe_beta = jnp.where(reflect, beta, 1)
    tau = jnp.where(reflect, jnp.asarray((beta - real) / safe_beta - 1j * imaginary / safe_beta, alpha.dtype), 0)
    scale = jnp.where(reflect, 1 / jnp.where(reflect, alpha - beta, 1), 0)
    return jnp.where(reflect, beta.astype(alpha.dtype), alpha), tau, scale


def _lartg(f, g):
    """LAPACK's ``slartg`` (3.10 and later): (c, s, r) with ``[c s; -s c] [f; g] = [r; 0]``, ``r`` of f's sign."""
    import jax.numpy as jnp

    d = jnp.hypot(f, g)
    safe_d = jnp.where(d == 0, 1, d)
    r = jnp.where(f >= 0, d, -d)
    safe_r = jnp.where(r == 0, 1, r)
    c = jnp.where(g == 0, 1, jnp.where(f == 0, 0, jnp.abs(f) / safe_d))
    s = jnp.where(g == 0, 0, jnp.where(f == 0, jnp.sign(g), g / safe_r))
    r = jnp.where(g == 0, f, jnp.where(f == 0, jnp.abs(g), r))
    return c, s, r


# --- SVD -----------------------------------------------------------------------------------------------------------


def _lapack_threshold(k: int) -> int:
    """Reference ``gesdd``'s MNTHR: a matrix with ``max(m, n) >= MNTHR`` (``k = min(m, n)``) is QR- or
    LQ-factored before it is bidiagonalised."""
    return int(k * 11.0 / 6.0)


def _mkl_qr_threshold(n: int) -> int:
    """The MNTHR of MKL's ``gesdd`` for tall matrices (found by experiment): QR-factored from ``m >= 1.5 n``."""
    return n + n // 2


def _gebrd_wide(a):
    """``sgebd2`` of one m x n matrix with m < n: ``A = Q B P^T``, B lower bidiagonal with diagonal ``d`` and
    subdiagonal ``e`` (the last entry unused). Returns d, e, Q (m x m), P (n x n)."""
    import jax.numpy as jnp
    from jax import lax

    m, n = a.shape
    rows, cols = jnp.arange(m), jnp.arange(n)
    dtype = a.dtype

    def step(i, state):
        a, d, e, q, p = state
        # G(i) annihilates A(i, i+1:n); applied to A(i+1:m, i:n) from the right.
        row = a[i]
        beta, tau, scale = _larfg(row[i], jnp.linalg.norm(jnp.where(cols > i, row, 0)))
        v = jnp.where(cols > i, row * scale, (cols == i).astype(dtype))
        w = jnp.where(rows > i, a @ v, 0)
        a = a - tau * w[:, None] * v[None, :]
        p = p - tau * (p @ v)[:, None] * v[None, :]
        d = d.at[i].set(beta)
        # H(i) annihilates A(i+2:m, i); applied to A(i+1:m, i+1:n) from the left.
        column = a[:, i]
        beta, tau, scale = _larfg(column[jnp.minimum(i + 1, m - 1)],
                                  jnp.linalg.norm(jnp.where(rows > i + 1, column, 0)))
        active = i + 1 < m
        tau = jnp.where(active, tau, 0)
        u = jnp.where(rows > i + 1, column * scale, (rows == i + 1).astype(dtype))
        z = jnp.where(cols > i, u @ a, 0)
        a = a - tau * u[:, None] * z[None, :]
        q = q - tau * (q @ u)[:, None] * u[None, :]
        e = e.at[i].set(jnp.where(active, beta, 0))
        return a, d, e, q, p

    state = (a, jnp.zeros(m, dtype), jnp.zeros(m, dtype), jnp.eye(m, dtype=dtype), jnp.eye(n, dtype=dtype))
    _, d, e, q, p = lax.fori_loop(0, m, step, state)
    return d, e, q, p


def _lower_to_upper_bidiagonal(d, e):
    """``sbdsdc``'s Givens rotations from the left that make a lower bidiagonal matrix upper bidiagonal:
    returns (d, e) of the upper one and R with ``B_lower = R B_upper``."""
    import jax.numpy as jnp
    from jax import lax

    m = d.shape[0]

    def step(i, state):
        d, e, r = state
        c, s, rr = _lartg(d[i], e[i])
        following = d[i + 1]
        d = d.at[i].set(rr).at[i + 1].set(c * following)
        e = e.at[i].set(s * following)
        left, right = r[:, i], r[:, i + 1]
        r = r.at[:, i].set(c * left + s * right).at[:, i + 1].set(c * right - s * left)
        return d, e, r

    return lax.fori_loop(0, m - 1, step, (d, e, jnp.eye(m, dtype=d.dtype)))


def _svd_wide_direct(a, full_matrices: bool):
    """The SVD of one wide matrix the way MKL's ``gesdd`` computes it (see the module docstring)."""
    import jax.numpy as jnp

    m = a.shape[0]
    d, e, q, p = _gebrd_wide(a)
    d, e, rotation = _lower_to_upper_bidiagonal(d, e)
    upper = jnp.diag(d) + jnp.diag(e[: m - 1], 1)
    ub, s, vtb = jnp.linalg.svd(upper, full_matrices=False)
    u = q @ (rotation @ ub)
    vh = vtb @ p[:, :m].T
    if full_matrices:
        vh = jnp.concatenate([vh, p[:, m:].T], axis=0)
    return u, s, vh


def _svd_tall_qr(a, full_matrices: bool):
    """``gesdd``'s path for tall matrices through a QR factorisation: ``A = Q R``, ``R = U_R S V^T``,
    ``U = Q U_R`` (then the rest of a complete Q)."""
    import jax.numpy as jnp

    n = a.shape[-1]
    q, r = jnp.linalg.qr(a, mode="complete" if full_matrices else "reduced")
    ur, s, vh = jnp.linalg.svd(r[..., :n, :], full_matrices=False)
    u = q[..., :, :n] @ ur
    if full_matrices:
        u = jnp.concatenate([u, q[..., :, n:]], axis=-1)
    return u, s, vh


def _jax_svd(a, full_matrices: bool, compute_uv: bool):
    import jax.numpy as jnp

    m, n = a.shape[-2:]
    if not compute_uv or jnp.iscomplexobj(a):  # the MKL-matching paths below are real-only
        return jnp.linalg.svd(a, full_matrices=full_matrices, compute_uv=compute_uv)
    if m > n and _mkl_qr_threshold(n) <= m < _lapack_threshold(n):
        return _svd_tall_qr(a, full_matrices)
    if m < n and n >= _lapack_threshold(m):
        return _batched(functools.partial(_svd_wide_direct, full_matrices=full_matrices), a, core_ranks=(2,))
    return tuple(jnp.linalg.svd(a, full_matrices=full_matrices))


@register_rule(aten._linalg_svd.default)
def _linalg_svd(ctx, a, full_matrices=False, compute_uv=True, *, driver=None):
    specs = ctx.avals_out
    if builder.numel(builder.shape_of(a)) == 0:
        # No matrix entries: S is empty; a full U or Vh of a matrix with no rows or columns is the identity.
        return [_identity_or_zeros(spec) for spec in specs]
    if not compute_uv:
        s = jax_bridge.call("linalg_svdvals", functools.partial(_jax_svd, full_matrices=False, compute_uv=False),
                            [a], [specs[1]])[0]
        return _zeros(specs[0]), s, _zeros(specs[2])
    fn = functools.partial(_jax_svd, full_matrices=full_matrices, compute_uv=True)
    return jax_bridge.call("linalg_svd", fn, [a], list(specs), params=(full_matrices,))


# --- symmetric eigendecomposition ---------------------------------------------------------------------------------

_STEQR_MAX_ORDER = 25
"""``sstedc``'s SMLSIZ: ``syevd`` of a larger matrix divides and conquers (where MKL and reference LAPACK
agree, so jax's eigh is used); up to this order it runs ``ssteqr`` on the tridiagonal matrix."""


def _lartg_lapack39(f, g):
    """``slartg`` as LAPACK had it before 3.10, which MKL's ``ssteqr`` uses: ``r = +-sqrt(f^2 + g^2)``, its sign
    flipped (with c and s) only when ``|f| > |g|`` and ``f < 0``."""
    import jax.numpy as jnp

    r = jnp.sqrt(f * f + g * g)
    safe_r = jnp.where(r == 0, 1, r)
    c, s = f / safe_r, g / safe_r
    flip = (jnp.abs(f) > jnp.abs(g)) & (c < 0)
    c, s, r = jnp.where(flip, -c, c), jnp.where(flip, -s, s), jnp.where(flip, -r, r)
    c = jnp.where(g == 0, 1, jnp.where(f == 0, 0, c))
    s = jnp.where(g == 0, 0, jnp.where(f == 0, 1, s))
    r = jnp.where(g == 0, f, jnp.where(f == 0, g, r))
    return c, s, r


def _laev2(a, b, c):
    """LAPACK ``slaev2``: eigenvalues ``rt1`` (larger in magnitude), ``rt2`` of [[a, b], [b, c]] and the unit
    eigenvector (cs1, sn1) of rt1."""
    import jax.numpy as jnp

    sm, df, tb = a + c, a - c, b + b
    adf, ab = jnp.abs(df), jnp.abs(tb)
    larger = jnp.abs(a) > jnp.abs(c)
    acmx, acmn = jnp.where(larger, a, c), jnp.where(larger, c, a)
    safe_adf, safe_ab = jnp.where(adf == 0, 1, adf), jnp.where(ab == 0, 1, ab)
    rt = jnp.where(adf > ab, adf * jnp.sqrt(1 + (ab / safe_adf) ** 2),
                   jnp.where(adf < ab, ab * jnp.sqrt(1 + (adf / safe_ab) ** 2), ab * jnp.sqrt(2.0).astype(a.dtype)))
    rt1 = jnp.where(sm < 0, 0.5 * (sm - rt), jnp.where(sm > 0, 0.5 * (sm + rt), 0.5 * rt))
    safe_rt1 = jnp.where(rt1 == 0, 1, rt1)
    rt2 = jnp.where(sm == 0, -0.5 * rt, (acmx / safe_rt1) * acmn - (b / safe_rt1) * b)
    sgn1 = jnp.where(sm < 0, -1, 1)
    cs = jnp.where(df >= 0, df + rt, df - rt)
    sgn2 = jnp.where(df >= 0, 1, -1)
    safe_cs = jnp.where(cs == 0, 1, cs)
    ct = -tb / safe_cs
    sn_a = 1 / jnp.sqrt(1 + ct * ct)
    tn = -cs / jnp.where(tb == 0, 1, tb)
    cs_b = 1 / jnp.sqrt(1 + tn * tn)
    by_cs = jnp.abs(cs) > ab
    cs1 = jnp.where(by_cs, ct * sn_a, jnp.where(ab == 0, 1, cs_b))
    sn1 = jnp.where(by_cs, sn_a, jnp.where(ab == 0, 0, tn * cs_b))
    swap = sgn1 == sgn2
    return rt1, rt2, jnp.where(swap, -sn1, cs1), jnp.where(swap, cs1, sn1)


def _rotate_columns(z, j, c, s):
    """``slasr('R', 'V', ...)`` for one rotation: columns j and j+1 of z."""
    left, right = z[:, j], z[:, j + 1]
    return z.at[:, j + 1].set(c * right - s * left).at[:, j].set(s * right + c * left)


def _sytd2(a, lower: bool):
    """LAPACK ``ssytd2`` of one symmetric matrix (only the ``lower``/upper triangle read): ``A = Q T Q^T`` with
    T tridiagonal. Returns its diagonal d, off-diagonal e (length n, the last entry unused) and Q (``sorgtr``)."""
    import jax.numpy as jnp
    from jax import lax

    n = a.shape[-1]
    dtype = a.dtype
    idx = jnp.arange(n)
    below = idx[:, None] >= idx[None, :]
    work = jnp.where(below, a, a.T) if lower else jnp.where(below, a.T, a)

    def step(t, state):
        work, e, q = state
        # lower: H(i), i = t, annihilates A(i+2:n, i); upper: H(i), i = n-2-t, annihilates A(0:i-1, i+1)
        i = t if lower else n - 2 - t
        if lower:
            column = work[:, i]
            alpha = column[i + 1]
            tail = idx > i + 1
            unit = idx == i + 1
            block = idx > i
        else:
            column = work[:, i + 1]
            alpha = column[i]
            tail = idx < i
            unit = idx == i
            block = idx <= i
        beta, tau, scale = _larfg(alpha, jnp.linalg.norm(jnp.where(tail, column, 0)))
        v = jnp.where(tail, column * scale, unit.astype(dtype))
        x = jnp.where(block, tau * (work @ v), 0)
        w = x - (0.5 * tau * jnp.dot(x, v)) * v
        inside = block[:, None] & block[None, :]
        work = jnp.where(inside, work - (v[:, None] * w[None, :] + w[:, None] * v[None, :]), work)
        q = q - tau * (q @ v)[:, None] * v[None, :]
        return work, e.at[i].set(beta), q

    state = (work, jnp.zeros(n, dtype), jnp.eye(n, dtype=dtype))
    work, e, q = lax.fori_loop(0, n - 1, step, state)
    return jnp.diagonal(work), e, q


def _steqr(d, e, z):
    """LAPACK ``ssteqr`` with ``compz='V'`` (implicit QL/QR with Wilkinson shifts), rotating the columns of z,
    with the ``slartg`` MKL uses; the eigenvalues are then sorted ascending with their vectors.

    ``e`` has length n (the last entry unused). Follows the reference routine step by step (0-based here):
    split the matrix at negligible off-diagonal entries, scale each block into range, iterate QL or QR on it
    depending on which end has the smaller diagonal entry, finish 2x2 blocks with ``slaev2``. A QR iteration
    is the QL iteration of the matrix with rows and columns reversed, operation for operation, so a block that
    wants QR is reversed, iterated with QL and reversed back (only the 2x2 blocks keep the original
    orientation for ``slaev2``).
    """
    import jax.numpy as jnp
    from jax import lax

    n = d.shape[0]
    dtype = d.dtype
    info = jnp.finfo(dtype)
    eps = jnp.asarray(info.eps / 2, dtype)
    eps2 = eps * eps
    safmin = jnp.asarray(info.tiny, dtype)
    ssfmax = jnp.sqrt(1 / safmin) / 3
    ssfmin = jnp.sqrt(safmin) / eps2
    max_sweeps = 30 * n
    idx = jnp.arange(n)
    one, zero = jnp.ones((), dtype), jnp.zeros((), dtype)

    def next_d(x):
        return jnp.concatenate([x[1:], x[-1:]])

    def mirror(d, e, z):
        return d[::-1], jnp.concatenate([e[: n - 1][::-1], e[n - 1:]]), z[:, ::-1]

    def ql_step(state):
        lo, lend, d, e, z, sweeps, mirrored = state
        small = (idx >= lo) & (idx < lend) & (e * e <= (eps2 * jnp.abs(d)) * jnp.abs(next_d(d)) + safmin)
        m = jnp.where(jnp.any(small), jnp.argmax(small), lend)
        e = jnp.where(m < lend, e.at[m].set(0), e)
        top = d[lo]
        case = jnp.where(m == lo, 0, jnp.where(m == lo + 1, 1, 2))

        # a 2x2 block: slaev2, on the block as it stands in the unreversed matrix
        first, last = jnp.where(mirrored, d[lo + 1], d[lo]), jnp.where(mirrored, d[lo], d[lo + 1])
        rt1, rt2, cs, sn = _laev2(first, e[lo], last)
        pair_d = d.at[lo].set(jnp.where(mirrored, rt2, rt1)).at[lo + 1].set(jnp.where(mirrored, rt1, rt2))
        pair_z = _rotate_columns(z, lo, cs, jnp.where(mirrored, -sn, sn))

        # a QL sweep from row m up to row lo, with the Wilkinson shift
        g = (d[lo + 1] - top) / (2 * e[lo])
        r = jnp.hypot(g, 1)
        g = d[m] - top + e[lo] / (g + jnp.where(g >= 0, r, -r))

        def rotation(k, inner):
            i = m - 1 - k
            g, s, c, p, d, e, z = inner
            f, b = s * e[i], c * e[i]
            c, s, r = _lartg_lapack39(g, f)
            e = jnp.where(i != m - 1, e.at[i + 1].set(r), e)
            g = d[i + 1] - p
            r = (d[i] - g) * s + 2 * c * b
            p = s * r
            d = d.at[i + 1].set(g + p)
            g = c * r - b
            return g, s, c, p, d, e, _rotate_columns(z, i, c, -s)

        rotations = jnp.where(case == 2, m - lo, 0)
        g, _, _, p, sweep_d, sweep_e, sweep_z = lax.fori_loop(0, rotations, rotation, (g, one, one, zero, d, e, z))
        sweep_d = sweep_d.at[lo].set(sweep_d[lo] - p)
        sweep_e = sweep_e.at[lo].set(g)

        d = jnp.where(case == 0, d, jnp.where(case == 1, pair_d, sweep_d))
        e = jnp.where(case == 0, e, jnp.where(case == 1, e.at[lo].set(0), sweep_e))
        z = jnp.where(case == 0, z, jnp.where(case == 1, pair_z, sweep_z))
        lo = lo + jnp.where(case == 0, 1, jnp.where(case == 1, 2, 0))
        return lo, lend, d, e, z, sweeps + (case == 2), mirrored

    def block(state):
        start, d, e, z, sweeps = state
        e = jnp.where(start > 0, e.at[start - 1].set(0), e)
        split = (idx >= start) & (idx <= n - 2) & (
            (e == 0) | (jnp.abs(e) <= (jnp.sqrt(jnp.abs(d)) * jnp.sqrt(jnp.abs(next_d(d)))) * eps))
        end = jnp.where(jnp.any(split), jnp.argmax(split), n - 1)
        e = jnp.where(jnp.any(split), e.at[end].set(0), e)
        in_block = (idx >= start) & (idx <= end)
        off_block = (idx >= start) & (idx < end)
        anorm = jnp.maximum(jnp.max(jnp.where(in_block, jnp.abs(d), 0)), jnp.max(jnp.where(off_block, jnp.abs(e), 0)))
        scale = jnp.where(anorm > ssfmax, ssfmax / anorm, jnp.where(anorm < ssfmin, ssfmin / anorm, 1))
        scale = jnp.where(anorm == 0, 1, scale)
        d = jnp.where(in_block, d * scale, d)
        e = jnp.where(off_block, e * scale, e)
        # QL when the top diagonal entry is the smaller (in magnitude), else QR, i.e. QL on the reversed matrix
        mirrored = jnp.abs(d[end]) < jnp.abs(d[start])
        d, e, z = (jnp.where(mirrored, x, y) for x, y in zip(mirror(d, e, z), (d, e, z), strict=True))
        lo, lend = jnp.where(mirrored, n - 1 - end, start), jnp.where(mirrored, n - 1 - start, end)
        active = (end > start) & (anorm > 0)
        state = (lo, lend, d, e, z, sweeps, mirrored)
        state = lax.while_loop(lambda s: active & (s[0] <= s[1]) & (s[5] < max_sweeps), ql_step, state)
        _, _, d, e, z, sweeps, _ = state
        d, e, z = (jnp.where(mirrored, x, y) for x, y in zip(mirror(d, e, z), (d, e, z), strict=True))
        d = jnp.where(in_block, d / scale, d)
        e = jnp.where(off_block, e / scale, e)
        return end + 1, d, e, z, sweeps

    state = (jnp.asarray(0), d, e, z, jnp.asarray(0))
    _, d, _, z, _ = lax.while_loop(lambda s: (s[0] < n) & (s[4] < max_sweeps), block, state)
    order = jnp.argsort(d, stable=True)
    return d[order], z[:, order]


def _eigh_small(a, lower: bool):
    """``syevd`` of one matrix of order 2..25 as MKL computes it: ``sytd2``, then its ``ssteqr``."""
    d, e, q = _sytd2(a, lower)
    return _steqr(d, e, q)


def _jax_eigh(a, lower: bool):
    import jax.numpy as jnp
    from jax import lax

    n = a.shape[-1]
    if 2 <= n <= _STEQR_MAX_ORDER and not jnp.iscomplexobj(a):  # the MKL-matching path is real-only
        return _batched(functools.partial(_eigh_small, lower=lower), a, core_ranks=(2,))
    vectors, values = lax.linalg.eigh(a, lower=lower, symmetrize_input=False, sort_eigenvalues=True)
    return values, vectors


def _jax_eigvalsh(a, lower: bool):
    from jax import lax

    return lax.linalg.eigh(a, lower=lower, symmetrize_input=False, sort_eigenvalues=True)[1]


@register_rule(aten._linalg_eigh.default)
def _linalg_eigh(ctx, a, UPLO="L", compute_v=True):
    specs = ctx.avals_out
    if builder.numel(builder.shape_of(a)) == 0:
        return [_zeros(spec) for spec in specs]
    lower = UPLO.upper() == "L"
    if not compute_v:
        values = jax_bridge.call("linalg_eigvalsh", functools.partial(_jax_eigvalsh, lower=lower), [a], [specs[0]],
                                 params=(lower,))[0]
        return values, _zeros(specs[1])
    return jax_bridge.call("linalg_eigh", functools.partial(_jax_eigh, lower=lower), [a], list(specs),
                           params=(lower,))


# --- general eigendecomposition -------------------------------------------------------------------------------


def _jax_eig(a):
    """Eigenvalues and right eigenvectors as LAPACK's ``geev`` gives them (jax calls it on the CPU, as PyTorch
    does): in its order, each vector of unit norm with its largest component real."""
    from jax import lax

    values, vectors = lax.linalg.eig(a, compute_left_eigenvectors=False)
    return values, vectors


@register_rule(aten.linalg_eig.default, platforms=("cpu",))
def _linalg_eig(ctx, a):
    specs = ctx.avals_out
    if builder.numel(builder.shape_of(a)) == 0:
        return [_zeros(spec) for spec in specs]
    return jax_bridge.call("linalg_eig", _jax_eig, [a], list(specs))


# --- pseudo-inverse ------------------------------------------------------------------------------------------------


def _jax_pinv(a, *tolerances, hermitian: bool, has_atol: bool, has_rtol: bool):
    """``torch.linalg.pinv``: singular values (|eigenvalues| for hermitian) at most
    ``max(atol, rtol * largest)`` are dropped; tolerances promote with the values as in PyTorch."""
    import jax.numpy as jnp

    tolerances = list(tolerances)
    atol = tolerances.pop(0) if has_atol else None
    rtol = tolerances.pop(0) if has_rtol else None
    m, n = a.shape[-2:]
    dtype = a.dtype
    default_rtol = jnp.asarray(jnp.finfo(dtype).eps * max(m, n), dtype)
    if rtol is None:
        rtol = default_rtol if atol is None else jnp.where(atol > 0, jnp.zeros((), dtype), default_rtol)
    if atol is None:
        atol = jnp.zeros((), dtype)
    if hermitian:
        from jax import lax

        vectors, values = lax.linalg.eigh(a, lower=True, symmetrize_input=False, sort_eigenvalues=True)
        magnitude = jnp.abs(values)
        largest = jnp.max(magnitude, axis=-1, keepdims=True)
        tol = jnp.maximum(atol[..., None], rtol[..., None] * largest)
        inverse = jnp.where(magnitude > tol, 1 / values, 0).astype(dtype)
        return jnp.matmul(vectors * inverse[..., None, :], _adjoint(vectors))
    u, s, vh = _jax_svd(a, full_matrices=False, compute_uv=True)
    tol = jnp.maximum(atol[..., None], rtol[..., None] * s[..., :1])
    inverse = jnp.where(s > tol, 1 / s, 0).astype(dtype)
    return jnp.matmul(_adjoint(vh) * inverse[..., None, :], _adjoint(u))


def _adjoint(matrix):
    """The conjugate transpose (the transpose of a real matrix)."""
    import jax.numpy as jnp

    return jnp.conj(jnp.swapaxes(matrix, -1, -2))


@register_rule(aten.linalg_pinv.atol_rtol_tensor)
def _linalg_pinv(ctx, a, atol=None, rtol=None, hermitian=False):
    spec = ctx.aval_out
    if builder.numel(builder.shape_of(a)) == 0:
        return _zeros(spec)
    operands = [a] + [t for t in (atol, rtol) if t is not None]
    params = (hermitian, atol is not None, rtol is not None)
    fn = functools.partial(_jax_pinv, hermitian=hermitian, has_atol=params[1], has_rtol=params[2])
    return jax_bridge.call("linalg_pinv", fn, operands, [spec], params=params)[0]


# --- QR and Householder products -----------------------------------------------------------------------------------


def _jax_qr(a, mode: str):
    import jax.numpy as jnp

    return jnp.linalg.qr(a, mode=mode)


@register_rule(aten.linalg_qr.default)
def _linalg_qr(ctx, a, mode="reduced"):
    q_spec, r_spec = ctx.avals_out
    if builder.numel(builder.shape_of(a)) == 0:
        # Q of a matrix with no rows or columns: the (complete) identity, or empty.
        return _identity_or_zeros(q_spec), _zeros(r_spec)
    if mode == "r":
        r = jax_bridge.call("linalg_qr_r", functools.partial(_jax_qr, mode="r"), [a], [r_spec])[0]
        return _zeros(q_spec), r
    return jax_bridge.call("linalg_qr", functools.partial(_jax_qr, mode=mode), [a], [q_spec, r_spec], params=(mode,))


def _geqr2(a):
    """LAPACK ``sgeqr2`` (``cgeqr2`` for complex matrices) of one matrix: R on and above the diagonal, the
    reflectors' tails below, and taus. (``jax.lax.linalg`` has no public ``geqrf``.)"""
    import jax.numpy as jnp
    from jax import lax

    m, n = a.shape
    k = min(m, n)
    rows, cols = jnp.arange(m), jnp.arange(n)
    larfg = _larfg_complex if jnp.iscomplexobj(a) else _larfg

    def step(i, state):
        a, taus = state
        column = a[:, i]
        beta, tau, scale = larfg(column[i], jnp.linalg.norm(jnp.where(rows > i, column, 0)))
        v = jnp.where(rows > i, column * scale, (rows == i).astype(a.dtype))
        # H(i)^H applied to A(i:m, i+1:n) from the left (H^T = H for real reflectors)
        z = jnp.where(cols > i, jnp.conj(v) @ a, 0)
        a = a - jnp.conj(tau) * v[:, None] * z[None, :]
        stored = jnp.where(rows > i, v, jnp.where(rows == i, beta, a[:, i]))
        return a.at[:, i].set(stored), taus.at[i].set(tau)

    return lax.fori_loop(0, k, step, (a, jnp.zeros(k, a.dtype)))


def _jax_geqrf(a):
    return _batched(_geqr2, a, core_ranks=(2,))


@register_rule(aten.geqrf.default)
def _geqrf(ctx, a):
    specs = list(ctx.avals_out)
    if builder.numel(builder.shape_of(a)) == 0:
        return [_zeros(spec) for spec in specs]
    return jax_bridge.call("geqrf", _jax_geqrf, [a], specs)


def _jax_householder_product(a, tau):
    from jax import lax

    return lax.linalg.householder_product(a, tau)


@register_rule(aten.linalg_householder_product.default)
def _householder_product(ctx, a, tau):
    spec = ctx.aval_out
    if builder.numel(spec.shape) == 0:
        return _zeros(spec)
    if builder.shape_of(tau)[-1] == 0:
        return builder.eye(spec.shape, spec.dtype)  # no reflectors: the first n columns of the identity
    return jax_bridge.call("householder_product", _jax_householder_product, [a, tau], [spec])[0]


def _jax_ormqr(a, tau, c, left: bool, transpose: bool):
    """``Q C``, ``Q^T C``, ``C Q`` or ``C Q^T`` for ``Q = H_1 ... H_k`` (``geqrf``'s reflectors in ``a``)."""
    import jax.numpy as jnp
    from jax import lax

    size = c.shape[-2] if left else c.shape[-1]
    k = tau.shape[-1]
    batch = jnp.broadcast_shapes(a.shape[:-2], c.shape[:-2])
    reflectors = jnp.zeros((*a.shape[:-2], size, size), a.dtype).at[..., :, :k].set(a[..., :size, :k])
    taus = jnp.zeros((*tau.shape[:-1], size), tau.dtype).at[..., :k].set(tau)
    q = lax.linalg.householder_product(reflectors, taus)
    q = jnp.broadcast_to(q, (*batch, size, size))
    if transpose:  # Q^H: the conjugate transpose, for complex reflectors
        q = _adjoint(q)
    return jnp.matmul(q, c) if left else jnp.matmul(c, q)


@register_rule(aten.ormqr.default)
def _ormqr(ctx, a, tau, c, left=True, transpose=False):
    spec = ctx.aval_out
    if builder.numel(spec.shape) == 0:
        return _zeros(spec)
    if builder.shape_of(tau)[-1] == 0:
        return builder.broadcast_to(c, spec.shape)
    fn = functools.partial(_jax_ormqr, left=left, transpose=transpose)
    return jax_bridge.call("ormqr", fn, [a, tau, c], [spec], params=(left, transpose))[0]


# --- LDL^T with Bunch-Kaufman pivoting -----------------------------------------------------------------------------

_BUNCH_KAUFMAN_ALPHA = (1 + math.sqrt(17)) / 8


def _sytf2_lower(a):
    """LAPACK ``ssytf2`` with ``uplo='L'`` on one matrix: (LD, 1-based pivots, info).

    Only the lower triangle of ``a`` is read. The trailing submatrix is kept as a full symmetric matrix, so an
    interchange is a symmetric permutation of it; columns of L already computed are not permuted (LAPACK's
    factored form, which ``sytrs`` undoes step by step).
    """
    import jax.numpy as jnp
    from jax import lax

    n = a.shape[-1]
    idx = jnp.arange(n)
    lower = idx[:, None] >= idx[None, :]
    work = jnp.where(lower, a, a.T)

    def first_argmax(values, mask):
        magnitude = jnp.where(mask, jnp.abs(values), -1)
        return jnp.argmax(magnitude), jnp.max(jnp.where(mask, jnp.abs(values), 0))

    def body(state):
        k, work, pivots, info = state
        column = work[:, k]
        absakk = jnp.abs(column[k])
        imax, colmax = first_argmax(column, idx > k)
        singular = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        # row imax of the trailing matrix, off its diagonal: A(imax, k:imax-1) and A(imax+1:n, imax)
        row = work[imax]
        _, rowmax = first_argmax(row, (idx >= k) & (idx != imax))
        no_swap = (absakk >= _BUNCH_KAUFMAN_ALPHA * colmax) | (
            absakk >= _BUNCH_KAUFMAN_ALPHA * colmax * (colmax / jnp.where(rowmax == 0, 1, rowmax)))
        swap_one = jnp.abs(work[imax, imax]) >= _BUNCH_KAUFMAN_ALPHA * rowmax
        kp = jnp.where(singular | no_swap, k, imax)
        two = ~singular & ~no_swap & ~swap_one
        kk = k + two.astype(k.dtype)
        # interchange rows and columns kk and kp of the trailing submatrix
        perm = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
        trailing = (idx[:, None] >= k) & (idx[None, :] >= k)
        work = jnp.where(trailing, work[perm][:, perm], work)

        def one_by_one(work):
            pivot = work[k, k]
            x = jnp.where(idx > k, work[:, k], 0)
            d11 = 1 / pivot
            update = x[:, None] * (-d11 * x)[None, :]
            block = (idx[:, None] > k) & (idx[None, :] > k)
            work = jnp.where(block, work + update, work)
            scaled = jnp.where(idx > k, x * d11, work[:, k])
            return work.at[:, k].set(scaled)

        def two_by_two(work):
            d21 = work[k + 1, k]
            d11 = work[k + 1, k + 1] / d21
            d22 = work[k, k] / d21
            t = 1 / (d11 * d22 - 1)
            d21 = t / d21
            below = idx > k + 1
            x = jnp.where(below, work[:, k], 0)
            y = jnp.where(below, work[:, k + 1], 0)
            wk = d21 * (d11 * x - y)
            wkp1 = d21 * (d22 * y - x)
            block = below[:, None] & below[None, :]
            updated = work - x[:, None] * wk[None, :] - y[:, None] * wkp1[None, :]
            work = jnp.where(block, updated, work)
            work = work.at[:, k].set(jnp.where(below, wk, work[:, k]))
            return work.at[:, k + 1].set(jnp.where(below, wkp1, work[:, k + 1]))

        updated = lax.cond(two, two_by_two, one_by_one, work)
        work = jnp.where(singular, work, updated)
        # keep the trailing matrix symmetric, from its lower triangle
        work = jnp.where(lower, work, work.T)
        pivot = (kp + 1).astype(jnp.int32)
        pivots = jnp.where(two, jnp.where((idx == k) | (idx == k + 1), -pivot, pivots),
                           jnp.where(idx == k, pivot, pivots))
        info = jnp.where((info == 0) & singular, (k + 1).astype(jnp.int32), info)
        return k + 1 + two.astype(k.dtype), work, pivots, info

    state = (jnp.asarray(0), work, jnp.zeros(n, jnp.int32), jnp.asarray(0, jnp.int32))
    _, work, pivots, info = lax.while_loop(lambda s: s[0] < n, body, state)
    return jnp.where(lower, work, 0), pivots, info


def _jax_ldl_factor(a):
    return _batched(_sytf2_lower, a, core_ranks=(2,))


@register_rule(aten.linalg_ldl_factor_ex.default, complex_values=False)
def _linalg_ldl_factor_ex(ctx, a, *, hermitian=False, check_errors=False):
    # Real matrices only, so hermitian and symmetric factorisations are the same.
    specs = list(ctx.avals_out)
    if builder.numel(builder.shape_of(a)) == 0:
        return [_zeros(spec) for spec in specs]
    return jax_bridge.call("linalg_ldl_factor_ex", _jax_ldl_factor, [a], specs)


def _sytrs_lower(ld, pivots, b):
    """LAPACK ``ssytrs`` with ``uplo='L'``: solve ``A X = B`` from ``sytrf``'s factored form."""
    import jax.numpy as jnp
    from jax import lax

    n = ld.shape[-1]
    idx = jnp.arange(n)

    def swap_rows(b, i, j):
        perm = jnp.where(idx == i, j, jnp.where(idx == j, i, idx))
        return b[perm]

    def forward(state):
        k, b = state
        p = pivots[k]

        def one(b):
            b = swap_rows(b, k, p - 1)
            column = jnp.where(idx > k, ld[:, k], 0)
            b = b - column[:, None] * b[k][None, :]
            return b.at[k].set(b[k] * (1 / ld[k, k]))

        def two(b):
            b = swap_rows(b, k + 1, -p - 1)
            below = idx > k + 1
            b = b - jnp.where(below, ld[:, k], 0)[:, None] * b[k][None, :]
            b = b - jnp.where(below, ld[:, k + 1], 0)[:, None] * b[k + 1][None, :]
            akm1k = ld[k + 1, k]
            akm1 = ld[k, k] / akm1k
            ak = ld[k + 1, k + 1] / akm1k
            denom = akm1 * ak - 1
            bkm1 = b[k] / akm1k
            bk = b[k + 1] / akm1k
            return b.at[k].set((ak * bkm1 - bk) / denom).at[k + 1].set((akm1 * bk - bkm1) / denom)

        single = p > 0
        b = lax.cond(single, one, two, b)
        return k + jnp.where(single, 1, 2), b

    _, b = lax.while_loop(lambda s: s[0] < n, forward, (jnp.asarray(0), b))

    def backward(state):
        k, b = state
        p = pivots[k]

        def one(b):
            column = jnp.where(idx > k, ld[:, k], 0)
            b = b.at[k].set(b[k] - column @ b)
            return swap_rows(b, k, p - 1)

        def two(b):
            below = idx > k
            b = b.at[k].set(b[k] - jnp.where(below, ld[:, k], 0) @ b)
            b = b.at[k - 1].set(b[k - 1] - jnp.where(below, ld[:, k - 1], 0) @ b)
            return swap_rows(b, k, -p - 1)

        single = p > 0
        b = lax.cond(single, one, two, b)
        return k - jnp.where(single, 1, 2), b

    _, b = lax.while_loop(lambda s: s[0] >= 0, backward, (jnp.asarray(n - 1), b))
    return (b,)


def _jax_ldl_solve(ld, pivots, b):
    import jax.numpy as jnp

    batch = jnp.broadcast_shapes(ld.shape[:-2], pivots.shape[:-1], b.shape[:-2])
    ld = jnp.broadcast_to(ld, (*batch, *ld.shape[-2:]))
    pivots = jnp.broadcast_to(pivots, (*batch, pivots.shape[-1]))
    b = jnp.broadcast_to(b, (*batch, *b.shape[-2:]))
    return _batched(_sytrs_lower, ld, pivots, b, core_ranks=(2, 1, 2))[0]


@register_rule(aten.linalg_ldl_solve.default, complex_values=False)
def _linalg_ldl_solve(ctx, ld, pivots, b, *, hermitian=False):
    spec = ctx.aval_out
    if builder.numel(spec.shape) == 0:
        return _zeros(spec)
    return jax_bridge.call("linalg_ldl_solve", _jax_ldl_solve, [ld, pivots, b], [spec])[0]


# --- matrix exponential --------------------------------------------------------------------------------------------


def _jax_matrix_exp(a):
    from jax.scipy.linalg import expm

    return expm(a)


@register_rule(aten.linalg_matrix_exp.default)
def _linalg_matrix_exp(ctx, a):
    spec = ctx.aval_out
    if builder.numel(spec.shape) == 0:
        return _zeros(spec)
    return jax_bridge.call("linalg_matrix_exp", _jax_matrix_exp, [a], [spec])[0]
