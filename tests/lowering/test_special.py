"""Special functions (Bessel, Airy, gamma family, zeta, orthogonal polynomials) against eager.

Inputs cover each function's domain and its edge values (NaN, infinities, zeros, poles, the ends of the
polynomials' interval, huge arguments where PyTorch's float32 rounding of the phase matters). Each test
compiles one function holding many ops, to keep the compile count low, and checks with the ``aten_ops``
fixture that the ops reached the backend (and were not decomposed away).
"""

from __future__ import annotations

import torch

from tests.support import assert_compiles_like_eager

aten = torch.ops.aten
S = torch.special

EDGES = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, -1e-30, 1e-5, 0.5, 1.0, -1.0, 2.0, -2.0,
         2.09, -2.09, 5.0, -5.0, 8.0, -8.0, 12.5, -12.5, 25.0, -60.0, 88.7, 89.0, -90.0, 103.9, 200.0, -500.0,
         1e4, -1e4, 123456.0, 1e8, -1e8, 1e20, 3e38]


def _draws(n: int, scale: float, seed: int) -> torch.Tensor:
    return (torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 2 - 1) * scale


def _wide(seed: int = 0) -> torch.Tensor:
    """Edge values, then draws at three scales."""
    return torch.cat([torch.tensor(EDGES), _draws(200, 10, seed), _draws(100, 40, seed + 1),
                      _draws(50, 1000, seed + 2)])


def _unary(x):
    return (torch.i0(x), S.i0e(x), S.i1(x), S.i1e(x), S.erfcx(x), S.log_ndtr(x), S.bessel_j0(x), S.bessel_j1(x),
            S.bessel_y0(x), S.bessel_y1(x), S.modified_bessel_i0(x), S.modified_bessel_i1(x),
            S.modified_bessel_k0(x), S.modified_bessel_k1(x), S.scaled_modified_bessel_k0(x),
            S.scaled_modified_bessel_k1(x), S.spherical_bessel_j0(x), S.airy_ai(x))


UNARY_OPS = {aten.i0.default, aten.special_i0e.default, aten.special_i1.default, aten.special_i1e.default,
             aten.special_erfcx.default, aten.special_bessel_j0.default, aten.special_bessel_j1.default,
             aten.special_bessel_y0.default, aten.special_bessel_y1.default,
             aten.special_modified_bessel_i0.default, aten.special_modified_bessel_i1.default,
             aten.special_modified_bessel_k0.default, aten.special_modified_bessel_k1.default,
             aten.special_scaled_modified_bessel_k0.default, aten.special_scaled_modified_bessel_k1.default,
             aten.special_spherical_bessel_j0.default, aten.special_airy_ai.default}


def test_bessel_airy_erfcx_float32(aten_ops):
    assert_compiles_like_eager(_unary, _wide())
    assert aten_ops >= UNARY_OPS


def test_unary_integer_and_bool_inputs():
    ints = torch.arange(-12, 13)
    bools = torch.arange(25) % 3 == 0  # as many as ints: one jax lowering serves both
    assert_compiles_like_eager(lambda i, b: (_unary(i), _unary(b), S.ndtri(b), S.ndtri(i)), ints, bools)


def test_ndtri():
    p = torch.cat([torch.tensor([0.0, 1.0, -0.5, 1.5, float("nan"), 1e-30, 1e-10, 0.5, 1 - 2 ** -24]),
                   torch.rand(300, generator=torch.Generator().manual_seed(3))])
    assert_compiles_like_eager(S.ndtri, p)


def test_bessel_i_bfloat16():
    x = _draws(64, 12, 4).bfloat16()
    assert_compiles_like_eager(lambda x: (torch.i0(x), S.i0e(x), S.i1(x), S.i1e(x)), x)


def test_polygamma(aten_ops):
    # Negative non-integers, the poles 0 and -k (PyTorch's float32 trigamma gives huge finite values at -k).
    x = torch.cat([torch.tensor([0.0, -0.0, -1.0, -2.0, -2.5, -8.48, 1e-30, float("inf"), float("-inf"),
                                 float("nan"), 1.0, 0.5, 1e4, -3.999]), _draws(150, 9, 5), _draws(50, 100, 6)])

    def fn(x):
        return (*(torch.polygamma(n, x) for n in range(6)), S.polygamma(7, x.abs() + 0.5))

    assert_compiles_like_eager(fn, x)
    assert aten.polygamma.default in aten_ops


def test_polygamma_low_precision_and_integers():
    x = _draws(40, 9, 7)
    fn = lambda x: tuple(torch.polygamma(n, x) for n in range(4))  # noqa: E731
    assert_compiles_like_eager(fn, x.bfloat16())
    assert_compiles_like_eager(fn, torch.arange(-3, 10))


def test_zeta(aten_ops):
    values = [float("nan"), float("inf"), float("-inf"), 0.0, 1.0, 0.5, 2.0, 3.0, 4.0, 7.0, -2.5, -3.5, -8.48,
              -9.0, 1e-30, 1e3, 40.0]
    x, q = torch.tensor(values).repeat_interleave(len(values)), torch.tensor(values).repeat(len(values))
    rx, rq = _draws(300, 9, 8), _draws(300, 9, 9)

    def fn(x, q, rx, rq):
        return (S.zeta(x, q), S.zeta(rx, rq), S.zeta(rx.abs() + 1, rq), S.zeta(3.0, rq), S.zeta(rx, 2.5),
                S.zeta(torch.arange(1, 8), torch.arange(-3, 4)))

    assert_compiles_like_eager(fn, x, q, rx, rq)
    assert aten.special_zeta.default in aten_ops


def test_incomplete_gamma(aten_ops):
    values = [float("nan"), float("inf"), 0.0, -1.0, 1e-30, 0.5, 1.0, 3.0, 50.0, 250.0, 1e4]
    a, x = torch.tensor(values).repeat_interleave(len(values)), torch.tensor(values).repeat(len(values))
    ga = torch.Generator().manual_seed(10)
    ra, rx = torch.rand(200, generator=ga) * 12, torch.rand(200, generator=ga) * 18
    # Large a near x: PyTorch's uniform asymptotic branch, where its float32 eta loses digits.
    big = torch.rand(100, generator=ga) * 1e6 + 200
    near = big * (1 + torch.randn(100, generator=ga) * 2 / big.sqrt())

    a, x = torch.cat([a, ra, big, ra * 30]), torch.cat([x, rx, near, rx * 30])  # one shape: one jax lowering
    assert_compiles_like_eager(lambda a, x: (torch.igamma(a, x), torch.igammac(a, x)), a, x)
    assert {aten.igamma.default, aten.igammac.default} <= aten_ops
    assert_compiles_like_eager(lambda a, x: (torch.igamma(a, x), torch.igammac(a, x)), ra.bfloat16(), rx.bfloat16())


CHEBYSHEV = [S.chebyshev_polynomial_t, S.chebyshev_polynomial_u, S.chebyshev_polynomial_v,
             S.chebyshev_polynomial_w, S.shifted_chebyshev_polynomial_t, S.shifted_chebyshev_polynomial_u,
             S.shifted_chebyshev_polynomial_v, S.shifted_chebyshev_polynomial_w]
OTHERS = [S.hermite_polynomial_h, S.hermite_polynomial_he, S.laguerre_polynomial_l, S.legendre_polynomial_p]


def _polynomial_inputs():
    g = torch.Generator().manual_seed(11)
    # x on the interval (closed forms for high degree), at its ends, and outside; ends of the shifted one.
    ends = torch.tensor([1.0, -1.0, 0.0, 0.5, 1 - 2 ** -24, -1 + 2 ** -24, 1e-30, 1.0000001, 3.0, -2.5])
    x = torch.cat([ends.repeat(4), torch.rand(160, generator=g) * 2.4 - 1.2, torch.rand(80, generator=g) * 20 - 10])
    # Degrees: fractional (truncated), negative, zero, one, up to 20, and non-finite (counted as negative).
    n_ends = torch.tensor([0.0, 1.0, 2.0, 7.0, 9.0, 20.0, -1.0, -0.5, 2.9, float("nan"), float("inf"), 1e30])
    n = torch.cat([n_ends.repeat(4)[: len(ends) * 4], torch.rand(240, generator=g) * 22 - 2])
    return x, n


def test_chebyshev_polynomials(aten_ops):
    x, n = _polynomial_inputs()

    def fn(x, n):
        return (*(f(x, n) for f in CHEBYSHEV), *(f(x, 5) for f in CHEBYSHEV), *(f(0.3, n) for f in CHEBYSHEV))

    assert_compiles_like_eager(fn, x, n)
    names = ["t", "u", "v", "w"]
    expected = {getattr(aten, f"special_{s}chebyshev_polynomial_{k}").default for k in names for s in ("", "shifted_")}
    assert expected <= aten_ops


def test_hermite_laguerre_legendre(aten_ops):
    x, n = _polynomial_inputs()
    high = torch.tensor([127.0, 128.0, 129.0, 300.0, 600.0]).repeat(2)  # PyTorch's float32 Hermite limit is 128
    xh = torch.tensor([0.5, -0.3, 1.1, 0.0, 2.0]).repeat_interleave(2)

    def fn(x, n, high, xh):
        return (*(f(x, n) for f in OTHERS), *(f(x, 4) for f in OTHERS), *(f(-0.7, n) for f in OTHERS),
                S.hermite_polynomial_h(xh * 0.1, high), S.hermite_polynomial_he(xh * 0.1, high))

    assert_compiles_like_eager(fn, x, n, high, xh)
    expected = {aten.special_hermite_polynomial_h.default, aten.special_hermite_polynomial_he.default,
                aten.special_laguerre_polynomial_l.default, aten.special_legendre_polynomial_p.default}
    assert expected <= aten_ops


def test_polynomials_integer_inputs():
    x = torch.arange(-3, 4).repeat(5)
    n = torch.arange(0, 7).repeat_interleave(5)
    assert_compiles_like_eager(lambda x, n: tuple(f(x, n) for f in CHEBYSHEV + OTHERS), x, n)


def test_empty_inputs():
    e = torch.empty(0, 3)
    assert_compiles_like_eager(lambda e: (S.bessel_j0(e), S.zeta(e, e), S.chebyshev_polynomial_t(e, e),
                                          torch.igamma(e, e), torch.polygamma(2, e)), e)
