"""Special functions: Bessel and Airy functions, the gamma family, Hurwitz zeta, orthogonal polynomials.

Every rule calls a jax function through ``jax_bridge``: where ``jax.scipy.special`` or
``jax.lax`` compute the function well (``i0``, ``i0e``, ``i1``, ``i1e``, ``ndtri``, ``digamma``, the
incomplete gamma functions away from their large-parameter regime) it is used; everything else is written
here from the mathematics, in jax:

* Bessel J0/J1/Y0/Y1: the power series (DLMF 10.2.2, 10.8.1) for ``|x| <= 12.5`` and Hankel's asymptotic
  expansion (DLMF 10.17.3) beyond;
* modified Bessel K0/K1 and their scaled forms: the power series (DLMF 10.31.1) for ``x <= 2`` and the
  trapezoidal rule on ``e^x K_nu(x) = int_0^inf exp(-x (cosh t - 1)) cosh(nu t) dt`` beyond, whose step
  shrinks as ``1/sqrt(x)`` so that 32 nodes are exact to double precision for every ``x``;
* Airy Ai: the Maclaurin series for ``-8 <= x <= 2``, ``Ai(x) = sqrt(x/3) K_{1/3}(zeta) / pi`` (the same
  quadrature) above, the oscillatory asymptotic expansion (DLMF 9.7.9) below;
* Hurwitz zeta (and polygamma of order >= 2 through it): direct summation up to ``q + N > 9``, then the
  Euler-Maclaurin tail with Bernoulli numbers, with the same domain rules and stopping tests as PyTorch;
* the incomplete gamma functions for ``a >= 200``: Temme's uniform expansion (DLMF 8.12.3-4) with two
  correction terms (``jax.lax.igamma`` needs O(sqrt(a)) iterations there and never ends for huge ``a``);
* orthogonal polynomials: PyTorch's three-term recurrences, run in a ``while`` loop up to the largest degree
  in the tensor, with its closed forms and its values at the interval ends.

Float32 results are computed in float64 and rounded once, except where PyTorch's own float32 arithmetic
shapes the result far beyond a rounding error, which is then reproduced: the phase ``x - pi/4`` of the large-x
Bessel and Airy expansions is rounded to the input dtype first (for ``x`` around 1e8 that rounding moves the
phase by radians), so is Temme's ``eta`` in PyTorch's large-``a`` incomplete gamma branch (its float32
``log1p(s) - s`` cancels), the polynomial recurrences and trigamma run in the input dtype with the fused
multiply-adds PyTorch's x86 build uses (float32 recurrences agree bit for bit), and ``i0``/``i1`` overflow
where PyTorch's float32 ``exp(|x|)`` does. Transcendental calls inside that emulation are evaluated in
float64 and rounded, which is what a correctly rounded libm returns; so are divisions, which XLA would
otherwise turn into multiplications by a rounded reciprocal.

Not kept: where eager reads an uninitialised variable (Chebyshev U/W, Laguerre, Legendre of a NaN ``x``
with degree >= 2 return 1.0 on PyTorch's x86 build) we return NaN; float32 ``igamma`` with ``a`` near the
float32 maximum, where eager's float32 arithmetic overflows to NaN, gives the true value; in float64, eager's
own approximations of J0/J1/Y0/Y1 for 5 < x < 7 and of Ai near x = -2.1 are off by up to 3e-6, ours are not
(so float64 results differ from eager there by more than 1e-7). The polynomial loops run up to the largest
degree in the tensor (eager loops per element, much faster per step), and Hurwitz zeta with a large
negative ``q`` sums ``-q`` terms, as eager does.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import torch

from tpucompile.lowering import builder, jax_bridge
from tpucompile.lowering.registry import PromotionKind as K
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.types import TensorSpec

aten = torch.ops.aten

_EULER_GAMMA = 0.57721566490153286060651209008240243
_BESSEL_SERIES_LIMIT = 12.5
_K_SERIES_LIMIT = 2.0
_TEMME_MIN_A = 200.0


# --- coefficients, derived from their definitions ---------------------------------------------------------


def _bernoulli(count: int) -> list[Fraction]:
    """B_0 .. B_{count-1} (with B_1 = -1/2), from the recurrence sum_{j<=m} C(m+1, j) B_j = 0."""
    numbers: list[Fraction] = []
    for m in range(count):
        if m == 0:
            numbers.append(Fraction(1))
            continue
        total = sum(math.comb(m + 1, j) * numbers[j] for j in range(m))
        numbers.append(-total / (m + 1))
    return numbers


_BERNOULLI = _bernoulli(26)
_EULER_MACLAURIN = [float(Fraction(math.factorial(2 * i + 2)) / _BERNOULLI[2 * i + 2]) for i in range(12)]
"""(2i+2)! / B_{2i+2}: the Euler-Maclaurin divisors of the zeta tail."""


def _hankel(nu: int, count: int) -> list[float]:
    """a_k(nu) = prod_{j<=k} (4 nu^2 - (2j-1)^2) / (k! 8^k), the terms of Hankel's expansion."""
    mu = 4 * nu * nu
    terms, value = [], Fraction(1)
    for k in range(count):
        if k:
            value *= Fraction(mu - (2 * k - 1) ** 2, 8 * k)
        terms.append(float(value))
    return terms


_HANKEL = {0: _hankel(0, 26), 1: _hankel(1, 26)}


def _airy_u(count: int) -> list[float]:
    """u_k = (2k+1)(2k+3)...(6k-1) / (216^k k!) of the Airy asymptotic expansions (DLMF 9.7.2)."""
    terms, value = [], Fraction(1)
    for k in range(count):
        if k:
            value *= Fraction((6 * k - 5) * (6 * k - 3) * (6 * k - 1), 216 * k * (2 * k - 1))
        terms.append(float(value))
    return terms


_AIRY_U = _airy_u(32)
_AIRY_C1 = 0.355028053887817239260063186004183177  # Ai(0) = 3^(-2/3) / Gamma(2/3)
_AIRY_C2 = 0.258819403792806798405183560189203963  # -Ai'(0) = 3^(-1/3) / Gamma(1/3)

# Taylor coefficients in eta of Temme's c_0 and c_1 (DLMF 8.12.8-8.12.10), for small |eta| where their
# closed forms cancel.
_TEMME_C0 = [-1 / 3, 1 / 12, -2 / 135, 1 / 864, 1 / 2835, -139 / 777600, 1 / 25515, -571 / 261273600]
_TEMME_C1 = [-1 / 540, -1 / 288, 1 / 378, -77 / 77760, 1 / 4860]


# --- jax helpers --------------------------------------------------------------------------------------------


def _np():
    import jax.numpy as jnp

    return jnp


def _f64(x):
    return x.astype(_np().float64)


def _libm(fn, x):
    """``fn`` as a correctly rounded libm call in ``x``'s dtype: evaluated in float64, rounded once."""
    return fn(_f64(x)).astype(x.dtype)


def _fma(a, b, c):
    """a * b + c rounded once, as PyTorch's x86 builds compute ``a * b - d`` in its recurrences (the compiler
    fuses them). Exact for float32 through float64; float64 is left to XLA, which fuses the same way."""
    jnp = _np()
    if a.dtype == jnp.float64:
        return a * b + c
    return (_f64(a) * _f64(b) + _f64(c)).astype(a.dtype)


def _divide(a, b):
    """a / b rounded once. XLA rewrites a division by a broadcast scalar as a multiplication by its rounded
    reciprocal; in float64 that error stays far below a float32 rounding."""
    jnp = _np()
    if a.dtype == jnp.float64:
        return a / b
    return (_f64(a) / _f64(b)).astype(a.dtype)


def _horner(coefficients, z):
    """sum_k coefficients[k] z^k."""
    total = 0.0
    for c in reversed(coefficients):
        total = total * z + c
    return total


def _harmonic(k: int) -> float:
    return float(sum(Fraction(1, j) for j in range(1, k + 1)))


# --- modified Bessel I (jax) and overflow as in PyTorch --------------------------------------------------


def _like_eager_exp(x, value, odd):
    """Infinite where PyTorch's ``exp(|x|)`` in x's dtype (float32 for low-precision input) overflows, and
    NaN at x = +-inf (its Chebyshev series gives 0 there, times exp(inf))."""
    jnp = _np()
    overflow = jnp.copysign(jnp.inf, _f64(x)) if odd else jnp.inf
    value = jnp.where(jnp.isinf(jnp.exp(jnp.abs(x))), overflow, value)
    return jnp.where(jnp.isinf(x), jnp.nan, value).astype(x.dtype)


def _jax_i0(x):
    import jax.scipy.special as jss

    return _like_eager_exp(x, jss.i0(_f64(x)), odd=False)


def _jax_i1(x):
    import jax.scipy.special as jss

    return _like_eager_exp(x, jss.i1(_f64(x)), odd=True)


def _jax_scipy(name, x):
    import jax.scipy.special as jss

    return getattr(jss, name)(_f64(x)).astype(x.dtype)


def _jax_erfcx(x):
    """jax's erfcx, except for x >= 12 where it underflows to 0 past ~26: the asymptotic series there."""
    import jax.scipy.special as jss

    jnp = _np()
    xd = _f64(x)
    large = xd >= 12.0
    safe = jnp.where(large, 1.0, xd)
    w = jnp.where(large, 1.0 / (2.0 * xd * xd), 0.0)
    series, term = 1.0, 1.0
    for k in range(1, 13):
        term = -term * (2 * k - 1) * w
        series = series + term
    asymptotic = series / (jnp.where(large, xd, 1.0) * math.sqrt(math.pi))
    return jnp.where(large, asymptotic, jss.erfcx(safe)).astype(x.dtype)


# --- Bessel J and Y -------------------------------------------------------------------------------------


def _phase(ax, shift):
    """``|x| - shift`` rounded in x's dtype, as PyTorch evaluates the argument of sin/cos; then float64."""
    jnp = _np()
    return _f64(ax - jnp.asarray(shift, ax.dtype))


def _hankel_pq(nu, xd):
    """Hankel's P_nu(x), Q_nu(x) (DLMF 10.17.3), for x >= 12.5."""
    a = _HANKEL[nu]
    inv = 1.0 / xd
    inv2 = inv * inv
    p = _horner([(-1) ** m * a[2 * m] for m in range(13)], inv2)
    q = inv * _horner([(-1) ** m * a[2 * m + 1] for m in range(12)], inv2)
    return p, q


def _bessel_series(nu, xd):
    """J_nu(x) and the power-series part of Y_nu(x) (DLMF 10.8.1) for nu in {0, 1}; |x| <= 12.5."""
    jnp = _np()
    z = 0.25 * xd * xd
    term = jnp.ones_like(xd)
    j_sum = term
    psi_sum = (1.0 - 2 * _EULER_GAMMA) * term if nu else jnp.zeros_like(xd)  # psi(1) + psi(2) for nu = 1
    for k in range(1, 44):
        term = term * -z / (k * (k + nu))
        j_sum = j_sum + term
        if nu:
            psi_sum = psi_sum + (_harmonic(k) + _harmonic(k + 1) - 2 * _EULER_GAMMA) * term
        else:
            psi_sum = psi_sum + _harmonic(k) * term
    half = 0.5 * xd
    if nu == 0:
        j = j_sum
        y = (2 / math.pi) * ((jnp.log(half) + _EULER_GAMMA) * j - psi_sum)
    else:
        j = half * j_sum
        y = -2 / (math.pi * xd) + (2 / math.pi) * jnp.log(half) * j - half * psi_sum / math.pi
    return j, y


def _jax_bessel(kind, x):
    """Bessel J0, J1, Y0, Y1 of ``x`` (``kind`` is "j0", "j1", "y0" or "y1")."""
    jnp = _np()
    nu = int(kind[1])
    ax = jnp.abs(x)
    axd = _f64(ax)
    small = axd <= _BESSEL_SERIES_LIMIT
    j_small, y_small = _bessel_series(nu, jnp.where(small, axd, 1.0))
    big = jnp.where(small, _BESSEL_SERIES_LIMIT, axd)
    p, q = _hankel_pq(nu, big)
    phase = _phase(ax, (math.pi / 4) * (1 + 2 * nu))
    scale = jnp.sqrt(2 / (math.pi * big))
    if kind[0] == "j":
        value = jnp.where(small, j_small, scale * (p * jnp.cos(phase) - q * jnp.sin(phase)))
        if nu == 1:
            value = jnp.where(jnp.signbit(x), -value, value)
        return value.astype(x.dtype)
    value = jnp.where(small, y_small, scale * (p * jnp.sin(phase) + q * jnp.cos(phase)))
    value = jnp.where(x == 0, -jnp.inf, value)
    return jnp.where(x < 0, jnp.nan, value).astype(x.dtype)


def _jax_spherical_j0(x):
    jnp = _np()
    xd = _f64(x)
    value = jnp.where(xd == 0, 1.0, jnp.sin(xd) / jnp.where(xd == 0, 1.0, xd))
    return jnp.where(jnp.isinf(xd), 0.0, value).astype(x.dtype)


# --- modified Bessel K --------------------------------------------------------------------------------------


def _scaled_k_quadrature(nu, xd):
    """e^x K_nu(x) for x >= 1.5 by the trapezoidal rule on int_0^inf exp(-x (cosh t - 1)) cosh(nu t) dt.

    The integrand is analytic in a strip, so the rule converges exponentially; a step of 0.6 / sqrt(x)
    (at most 0.25) keeps the error below 1e-16 and 32 nodes reach past where the integrand underflows.
    """
    from jax import lax

    jnp = _np()
    h = jnp.minimum(0.25, 0.6 / jnp.sqrt(xd))

    def node(j, total):
        t = j.astype(jnp.float64) * h
        s = jnp.sinh(0.5 * t)
        return total + jnp.exp(-2.0 * xd * s * s) * jnp.cosh(nu * t)

    # A loop, not a (..., 32) array: nothing 32 times the input's size, and a small program to compile.
    return h * lax.fori_loop(1, 32, node, 0.5 * jnp.ones_like(xd))  # starts with the node t = 0, halved


def _k_series(nu, xd):
    """K_nu(x) for nu in {0, 1} by its power series (DLMF 10.31.1), for 0 < x <= 2."""
    jnp = _np()
    z = 0.25 * xd * xd
    half = 0.5 * xd
    log_half = jnp.log(half)
    term = jnp.ones_like(xd)
    i_sum = term
    psi_sum = (1.0 - 2 * _EULER_GAMMA) * term if nu else jnp.zeros_like(xd)
    for k in range(1, 30):
        term = term * z / (k * (k + nu))
        i_sum = i_sum + term
        if nu:
            psi_sum = psi_sum + (_harmonic(k) + _harmonic(k + 1) - 2 * _EULER_GAMMA) * term
        else:
            psi_sum = psi_sum + _harmonic(k) * term
    if nu == 0:
        return -(log_half + _EULER_GAMMA) * i_sum + psi_sum
    return 1.0 / xd + log_half * half * i_sum - 0.5 * half * psi_sum


def _jax_bessel_k(nu, scaled, x):
    jnp = _np()
    xd = _f64(x)
    small = xd <= _K_SERIES_LIMIT
    series = _k_series(nu, jnp.where(small, xd, 1.0))
    if scaled:
        series = series * jnp.exp(xd)
    quadrature = _scaled_k_quadrature(nu, jnp.where(small | jnp.isinf(xd), 4.0, xd))
    if not scaled:
        quadrature = quadrature * jnp.exp(-xd)
    value = jnp.where(small, series, quadrature)
    value = jnp.where(jnp.isinf(xd), 0.0, value)
    value = jnp.where(xd == 0, jnp.inf, value)
    return jnp.where(xd < 0, jnp.nan, value).astype(x.dtype)


# --- Airy Ai --------------------------------------------------------------------------------------------


def _jax_airy_ai(x):
    jnp = _np()
    xd = _f64(x)
    # Maclaurin series, -8 <= x <= 2 (its terms cancel to ~1e-9 absolute at x = -8, where the asymptotic
    # expansion below is no better).
    mid = (xd >= -8.0) & (xd <= 2.0)
    xm = jnp.where(mid, xd, 0.0)
    cube = xm * xm * xm
    m_term, n_term = jnp.ones_like(xm), xm
    f, g = m_term, n_term
    for k in range(1, 27):
        m_term = m_term * cube / ((3 * k - 1) * (3 * k))
        n_term = n_term * cube / ((3 * k) * (3 * k + 1))
        f, g = f + m_term, g + n_term
    maclaurin = _AIRY_C1 * f - _AIRY_C2 * g
    # x > 2: Ai(x) = sqrt(x/3) K_{1/3}(zeta) / pi, zeta = 2/3 x^{3/2}.
    xp = jnp.where(xd > 2.0, xd, 4.0)
    zeta_p = (2.0 / 3.0) * xp * jnp.sqrt(xp)
    positive = jnp.sqrt(xp / 3.0) / math.pi * jnp.exp(-zeta_p) * _scaled_k_quadrature(1.0 / 3.0, zeta_p)
    # x < -8: the oscillatory expansion, with PyTorch's phase zeta + pi/4 rounded in x's dtype.
    negative_side = xd < -8.0
    xn = jnp.where(negative_side, xd, -9.0)
    y = -xn
    zeta_n = (2.0 / 3.0) * y * jnp.sqrt(y)
    xt = jnp.where(negative_side, x, jnp.asarray(-9.0, x.dtype))
    two, three = jnp.asarray(-2.0, x.dtype), jnp.asarray(3.0, x.dtype)
    quarter_pi = jnp.asarray(np.float32(math.pi) * 0.25 if x.dtype != jnp.float64 else 0.25 * math.pi, x.dtype)
    zeta_t = _divide(two * xt * jnp.sqrt(-xt), three)
    theta = _f64(zeta_t + quarter_pi)
    inv = 1.0 / zeta_n
    inv2 = inv * inv
    p = _horner([(-1) ** m * _AIRY_U[2 * m] for m in range(16)], inv2)
    q = inv * _horner([(-1) ** m * _AIRY_U[2 * m + 1] for m in range(16)], inv2)
    negative = (jnp.sin(theta) * p - jnp.cos(theta) * q) / (math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(y)))
    value = jnp.where(mid, maclaurin, jnp.where(negative_side, negative, positive))
    value = jnp.where(xd > 103.892, 0.0, value)
    return jnp.where(jnp.isinf(xd) | jnp.isnan(xd), jnp.nan, value).astype(x.dtype)


# --- zeta and polygamma ---------------------------------------------------------------------------------


def _zeta_f64(x, q):
    """Hurwitz zeta(x, q) in float64 with PyTorch's (Cephes') domain rules and stopping tests."""
    from jax import lax

    jnp = _np()
    machep = 1.11022302462515654042e-16
    pole = (q <= 0) & (q == jnp.floor(q))
    rest = (x != 1) & ~(x < 1)  # NaN x passes both tests, as in PyTorch
    infinite = (x == 1) | (rest & pole)
    undefined = (x < 1) | (rest & (q <= 0) & ~pole & (x != jnp.floor(x)))
    special = infinite | undefined
    x = jnp.where(special, 2.0, x)
    q = jnp.where(special, 1.0, q)

    s = jnp.power(q, -x)
    done = jnp.zeros(x.shape, bool)

    def cond(state):
        i, a, _, _, done = state
        return jnp.any(((i < 9) | (a <= 9.0)) & ~done)

    def body(state):
        i, a, s, b, done = state
        active = ((i < 9) | (a <= 9.0)) & ~done
        a = jnp.where(active, a + 1.0, a)
        b = jnp.where(active, jnp.power(a, -x), b)
        s = jnp.where(active, s + b, s)
        done = done | (active & (-machep * s < b) & (b < machep * s))
        return i + 1, a, s, b, done

    state = (jnp.zeros((), jnp.int32), q, s, jnp.zeros_like(x), done)
    _, a, s, b, done = lax.while_loop(cond, body, state)
    # Euler-Maclaurin tail from w = q + N.
    w = a
    tail = s + b * w / (x - 1.0) - 0.5 * b
    s = jnp.where(done, s, tail)
    factor, k = jnp.ones_like(x), 0.0
    for divisor in _EULER_MACLAURIN:
        factor = factor * (x + k)
        b = b / w
        t = factor * b / divisor
        s = jnp.where(done, s, s + t)
        done = done | (jnp.abs(t / s) < machep)
        k += 1.0
        factor = factor * (x + k)
        b = b / w
        k += 1.0
    return jnp.where(infinite, jnp.inf, jnp.where(undefined, jnp.nan, s))


def _jax_zeta(x, q):
    return _zeta_f64(_f64(x), _f64(q)).astype(x.dtype)


def _jax_digamma(x):
    from jax import lax

    jnp = _np()
    xd = _f64(x)
    value = lax.digamma(xd)
    value = jnp.where((xd < 0) & (xd == jnp.trunc(xd)), jnp.nan, value)
    return jnp.where(xd == 0, jnp.copysign(jnp.inf, -xd), value).astype(x.dtype)


def _jax_trigamma(x):
    """PyTorch's trigamma, in x's own dtype (float32 or float64): reflection below 1/2, six recurrence
    steps, then the asymptotic series. Its float32 reflection gives huge finite values at the poles."""
    jnp = _np()
    dtype = x.dtype
    pi = jnp.asarray(math.pi, dtype)
    pi_squared = jnp.asarray(np.float32(math.pi) * np.float32(math.pi) if dtype != jnp.float64 else math.pi ** 2,
                             dtype)
    reflect = x < 0.5
    sin_pi_x = _libm(jnp.sin, pi * x) if dtype != jnp.float64 else jnp.sin(pi * x)
    result = jnp.where(reflect, -(pi_squared / (sin_pi_x * sin_pi_x)), jnp.zeros_like(x))
    x = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return jnp.where(reflect, -result, result)


def _jax_polygamma(n, x):
    jnp = _np()
    if n == 0:
        return _jax_digamma(x)
    if n == 1:
        return _jax_trigamma(x)
    zeta = _zeta_f64(jnp.full(x.shape, n + 1, jnp.float64), _f64(x)).astype(x.dtype)
    factorial = jnp.asarray(float(math.factorial(n)) if n < 171 else math.inf, x.dtype)
    return (1 if n % 2 else -1) * factorial * zeta


# --- incomplete gamma -----------------------------------------------------------------------------------


def _log1p_minus(mu):
    """mu - log1p(mu), without cancellation for small mu."""
    jnp = _np()
    small = jnp.abs(mu) < 0.1
    m = jnp.where(small, mu, 0.0)
    series = 0.0
    for k in range(19, 1, -1):
        series = (series + (-1) ** k / k) * m
    series = series * m
    return jnp.where(small, series, mu - jnp.log1p(jnp.where(small, 0.0, mu)))


def _temme(a, x, eta=None):
    """(P(a, x), Q(a, x)) by Temme's uniform expansion with c_0 and c_1: absolute error ~3e-9 at a = 200,
    falling as a^-2.5.

    ``eta`` (DLMF 8.12.1) is computed from a and x unless given."""
    from jax import lax

    jnp = _np()
    mu = (x - a) / a
    if eta is None:
        half_eta2 = _log1p_minus(mu)
        eta = jnp.sign(mu) * jnp.sqrt(2.0 * half_eta2)
    else:
        half_eta2 = 0.5 * eta * eta
    small = jnp.abs(eta) < 0.35
    safe_mu = jnp.where(small, 1.0, mu)
    safe_eta = jnp.where(small, 1.0, eta)
    c0 = jnp.where(small, _horner(_TEMME_C0, eta), 1.0 / safe_mu - 1.0 / safe_eta)
    closed_c1 = (1.0 / safe_eta ** 3 - 1.0 / safe_mu ** 3 - 1.0 / safe_mu ** 2 - 1.0 / (12.0 * safe_mu))
    c1 = jnp.where(small, _horner(_TEMME_C1, eta), closed_c1)
    r = jnp.exp(-a * half_eta2) / jnp.sqrt(2.0 * math.pi * a) * (c0 + c1 / a)
    u = eta * jnp.sqrt(0.5 * a)
    return 0.5 * lax.erfc(-u) - r, 0.5 * lax.erfc(u) + r


def _eager_eta(a, x, a_t, x_t):
    """Temme's eta where PyTorch's float32 kernel takes its asymptotic branch (a > 200, |x - a| / a <
    4.5 / sqrt(a)): it computes ``sqrt(-2 (log1p(sigma) - sigma))`` in float32, and that cancellation moves
    the result by up to ~1e-4 for large a. None in float64, where the cancellation costs nothing visible."""
    jnp = _np()
    if a.dtype == jnp.float64:
        return None
    two = jnp.asarray(2, a.dtype)
    sigma = _divide(x - a, a)
    magnitude = jnp.sqrt(-two * (_libm(jnp.log1p, sigma) - sigma))
    lam = _divide(x, a)
    eta = jnp.where(lam > 1, magnitude, jnp.where(lam < 1, -magnitude, jnp.zeros_like(a)))
    region = (a > 200) & (_divide(jnp.abs(x - a), a) < _divide(jnp.asarray(4.5, a.dtype), jnp.sqrt(a)))
    mu = (x_t - a_t) / a_t
    exact = jnp.sign(mu) * jnp.sqrt(2.0 * _log1p_minus(mu))
    return jnp.where(region, _f64(eta), exact)


def _jax_igamma(upper, a, x):
    from jax import lax

    jnp = _np()
    ad, xd = _f64(a), _f64(x)
    temme = ad >= _TEMME_MIN_A
    edge = (xd < 0) | (ad < 0) | (ad == 0) | (xd == 0) | jnp.isinf(ad) | jnp.isinf(xd)
    plain = ~(temme | edge)
    a_j, x_j = jnp.where(plain, ad, 1.0), jnp.where(plain, xd, 1.0)
    value = (lax.igammac if upper else lax.igamma)(a_j, x_j)
    a_t = jnp.where(temme & ~edge, ad, _TEMME_MIN_A)
    x_t = jnp.where(temme & ~edge, xd, _TEMME_MIN_A)
    p, q = _temme(a_t, x_t, _eager_eta(a, x, a_t, x_t))
    value = jnp.where(temme, q if upper else p, value)
    # PyTorch's boundary values, in its order of tests.
    at_infinity = 0.0 if upper else 1.0
    value = jnp.where(jnp.isinf(xd), at_infinity, value)
    value = jnp.where(jnp.isinf(ad), jnp.where(jnp.isinf(xd), jnp.nan, 1.0 - at_infinity), value)
    value = jnp.where(xd == 0, 1.0 - at_infinity, value)
    value = jnp.where(ad == 0, jnp.where(xd > 0, at_infinity, jnp.nan), value)
    value = jnp.where((xd < 0) | (ad < 0), jnp.nan, value)
    return value.astype(a.dtype)


# --- orthogonal polynomials -----------------------------------------------------------------------------

_CLOSED_FORM_DEGREE = {"t": 6, "u": 8, "v": 8, "w": 8, "st": 6, "su": 6, "sv": 6, "sw": 4}


def _degree(n):
    """PyTorch's static_cast<int64_t>(n): truncation; NaN, infinities and out-of-range values come out as
    INT64_MIN on the CPUs PyTorch runs on, so they count as a negative degree."""
    jnp = _np()
    valid = jnp.isfinite(n) & (jnp.abs(_f64(n)) < 2.0 ** 63)
    return jnp.where(valid, jnp.trunc(n), -1.0).astype(jnp.int64)


def _recurrence(step, q1, steps):
    """Apply ``r = step(j, p, q)`` for j = 1 .. steps (per element), from p = 1, q = q1; returns q.

    Elements whose value became NaN stop early, as PyTorch's loops do (it stays NaN either way)."""
    from jax import lax

    jnp = _np()

    def cond(state):
        j, _, q = state
        return jnp.any((j <= steps) & ~jnp.isnan(q))

    def body(state):
        j, p, q = state
        active = j <= steps
        r = step(j, p, q)
        return j + 1, jnp.where(active, q, p), jnp.where(active, r, q)

    state = (jnp.ones((), jnp.int64), jnp.ones_like(q1), q1)
    return lax.while_loop(cond, body, state)[2]


def _trig(fn, value, dtype):
    jnp = _np()
    return fn(value) if dtype == jnp.float64 else _libm(fn, value)


def _jax_chebyshev(kind, x, n):
    jnp = _np()
    dtype = x.dtype

    def c(v):
        return jnp.asarray(v, dtype)

    shifted = kind.startswith("s")
    family = kind[-1]
    n = _degree(n)
    y = x + x - c(1) if shifted else x
    two_y = y + y
    q1 = {"t": y, "u": two_y, "v": two_y - c(1), "w": two_y + c(1)}[family]
    even = n % 2 == 0
    nf, n1, n21 = n.astype(dtype), (n + 1).astype(dtype), (n + n + 1).astype(dtype)
    parity = jnp.where(even, c(1), c(-1))
    # Values at y = 1 and y = -1.
    at_one = {"t": c(1), "u": n1, "v": c(1), "w": n21}[family]
    at_minus_one = {"t": parity, "u": jnp.where(even, n1, -n1), "v": jnp.where(even, n21, -n21), "w": parity}[family]
    # Closed forms inside (-1, 1) for high degrees.
    theta = _trig(jnp.arccos, y, dtype)
    half = theta / c(2)
    if family == "t":
        closed = _trig(jnp.cos, nf * theta, dtype)
    elif family == "u":
        sin_theta = _trig(jnp.sin, theta, dtype)
        closed = jnp.where(sin_theta != 0, _trig(jnp.sin, n1 * theta, dtype) / sin_theta,
                           n1 * _trig(jnp.cos, n1 * theta, dtype) / y)
    elif family == "v":
        closed = jnp.where(_trig(jnp.sin, half, dtype) != 1,
                           _trig(jnp.cos, (nf + c(0.5)) * theta, dtype) / _trig(jnp.cos, half, dtype),
                           jnp.where(even, n21, -n21))
    else:
        fallback = parity if shifted else jnp.where(x > 0, n21, parity)
        closed = jnp.where(_trig(jnp.cos, half, dtype) != 1,
                           _trig(jnp.sin, (nf + c(0.5)) * theta, dtype) / _trig(jnp.sin, half, dtype), fallback)
    use_closed = (n > _CLOSED_FORM_DEGREE[kind]) & (jnp.abs(y) < 1)
    use_loop = (n >= 2) & ~use_closed
    looped = _recurrence(lambda j, p, q: _fma(two_y, q, -p), q1, jnp.where(use_loop, n - 1, 0))
    value = jnp.where(n == 1, q1, looped)
    value = jnp.where(n == 0, c(1), value)
    value = jnp.where(use_closed, closed, value)
    # The ends of the interval are tested on x (a tiny x rounds 2x - 1 to -1 without being an end).
    is_one, is_minus_one = (x == 1, x == 0) if shifted else (x == 1, x == -1)
    value = jnp.where(is_one, at_one, jnp.where(is_minus_one, at_minus_one, value))
    return jnp.where(n < 0, c(0), value)


def _jax_polynomial(kind, x, n):
    """Hermite H/He, Laguerre L, Legendre P, as PyTorch's recurrences compute them in x's dtype."""
    jnp = _np()
    dtype = x.dtype

    def c(v):
        return jnp.asarray(v, dtype)

    def f(j):
        return j.astype(dtype)

    n = _degree(n)
    one = jnp.ones_like(x)
    if kind == "h":
        q1 = x + x
        step = lambda j, p, q: _fma(x + x, q, -(f(2 * j) * p))  # noqa: E731
    elif kind == "he":
        q1 = x
        step = lambda j, p, q: _fma(x, q, -(f(j) * p))  # noqa: E731
    elif kind == "l":
        q1 = one - x
        step = lambda j, p, q: _divide(_fma(f(j + j) + (c(1) - x), q, -(f(j) * p)), f(j + 1))  # noqa: E731
    else:
        q1 = x
        step = lambda j, p, q: _divide(_fma(f(j + j + 1) * x, q, -(f(j) * p)), f(j + 1))  # noqa: E731
    if kind in ("h", "he"):
        special = n > (512 if dtype == jnp.float64 else 128)
        special_value = jnp.full_like(x, jnp.nan)
    elif kind == "l":
        special = jnp.abs(x) == 0
        special_value = one
    else:
        special = jnp.abs(x) == 1
        special_value = jnp.where((x > 0) | (n % 2 == 0), c(1), c(-1))
    use_loop = (n >= 2) & ~special
    value = _recurrence(step, q1, jnp.where(use_loop, n - 1, 0))
    value = jnp.where(n == 1, q1, value)
    value = jnp.where(n == 0, c(1), value)
    value = jnp.where(special, special_value, value)  # for H and He only n > limit, so never n < 2
    return jnp.where(n < 0, c(0), value)


# --- rules --------------------------------------------------------------------------------------------------


def _call(name, fn, operands, params=()):
    """``fn(*operands)`` (all in the compute dtype, already broadcast) as a call to a lowered jax function."""
    dtype = builder.dtype_of(operands[0])
    shape = tuple(builder.shape_of(operands[0]))
    if math.prod(shape) == 0:
        return builder.constant(0, dtype, shape)
    return jax_bridge.call(f"special_{name}", fn, list(operands), [TensorSpec(shape, dtype)], params=params)[0]


def _unary(name, fn, *ops):
    register_rule(*ops, promote=K.INT_TO_FLOAT)(lambda ctx, x: _call(name, fn, [x]))


def _binary(name, fn, *ops):
    register_rule(*ops, promote=K.INT_TO_FLOAT)(lambda ctx, a, b: _call(name, fn, [a, b]))


_unary("i0", _jax_i0, aten.i0.default, aten.special_modified_bessel_i0.default)
_unary("i1", _jax_i1, aten.special_i1.default, aten.special_modified_bessel_i1.default)
_unary("i0e", functools.partial(_jax_scipy, "i0e"), aten.special_i0e.default)
_unary("i1e", functools.partial(_jax_scipy, "i1e"), aten.special_i1e.default)
_unary("ndtri", functools.partial(_jax_scipy, "ndtri"), aten.special_ndtri.default)
_unary("erfcx", _jax_erfcx, aten.special_erfcx.default)
for _kind in ("j0", "j1", "y0", "y1"):
    _unary(f"bessel_{_kind}", functools.partial(_jax_bessel, _kind), getattr(aten, f"special_bessel_{_kind}").default)
_unary("bessel_k0", functools.partial(_jax_bessel_k, 0, False), aten.special_modified_bessel_k0.default)
_unary("bessel_k1", functools.partial(_jax_bessel_k, 1, False), aten.special_modified_bessel_k1.default)
_unary("bessel_k0e", functools.partial(_jax_bessel_k, 0, True), aten.special_scaled_modified_bessel_k0.default)
_unary("bessel_k1e", functools.partial(_jax_bessel_k, 1, True), aten.special_scaled_modified_bessel_k1.default)
_unary("spherical_bessel_j0", _jax_spherical_j0, aten.special_spherical_bessel_j0.default)
_unary("airy_ai", _jax_airy_ai, aten.special_airy_ai.default)

_binary("zeta", _jax_zeta, aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar)
_binary("igamma", functools.partial(_jax_igamma, False), aten.igamma.default)
_binary("igammac", functools.partial(_jax_igamma, True), aten.igammac.default)

for _kind in ("t", "u", "v", "w"):
    for _shifted in ("", "shifted_"):
        _packet = getattr(aten, f"special_{_shifted}chebyshev_polynomial_{_kind}")
        _name = ("s" if _shifted else "") + _kind
        _binary(f"chebyshev_{_name}", functools.partial(_jax_chebyshev, _name),
                _packet.default, _packet.x_scalar, _packet.n_scalar)
for _kind, _op in (("h", "hermite_polynomial_h"), ("he", "hermite_polynomial_he"),
                   ("l", "laguerre_polynomial_l"), ("p", "legendre_polynomial_p")):
    _packet = getattr(aten, f"special_{_op}")
    _binary(f"polynomial_{_kind}", functools.partial(_jax_polynomial, _kind),
            _packet.default, _packet.x_scalar, _packet.n_scalar)


@register_rule(aten.polygamma.default, promote=K.INT_TO_FLOAT, operands=(1,))
def _polygamma(ctx, n, x):
    return _call(f"polygamma_{n}", functools.partial(_jax_polygamma, int(n)), [x], params=(int(n),))
