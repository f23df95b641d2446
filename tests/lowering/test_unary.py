"""Unary math and activation functions vs eager, in every dtype eager supports them in."""

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager, floats_with_ties

# Seeded inputs; every op here must lower (conftest sets TPUCOMPILE_FALLBACK=error for the whole session).
pytestmark = pytest.mark.usefixtures("seeded")


FLOATS = [torch.float32, torch.bfloat16, torch.float16]
def _math(x, unit, pos):
    """``x`` anywhere (specials included), ``unit`` in (-1, 1), ``pos`` > 0."""
    return (
        torch.exp(x), torch.exp2(x), torch.expm1(x), torch.log(pos), torch.log(x), torch.log1p(x), torch.log2(pos),
        torch.log10(pos), torch.sqrt(pos), torch.sqrt(x), torch.rsqrt(pos), torch.rsqrt(x), torch.sin(x), torch.cos(x),
        torch.tan(unit), torch.asin(unit), torch.acos(unit), torch.atan(x), torch.sinh(unit * 3), torch.cosh(unit * 3),
        torch.tanh(x), torch.asinh(x), torch.acosh(pos + 1), torch.acosh(x), torch.atanh(unit), torch.atanh(x),
        torch.erf(x), torch.erfc(x), torch.erfinv(unit), torch.erfinv(x), torch.sigmoid(x), torch.reciprocal(x),
        torch.neg(x), torch.abs(x), torch.floor(x), torch.ceil(x), torch.round(x), torch.trunc(x), torch.sign(x),
        torch.sgn(x), torch.isnan(x), torch.isinf(x), torch.isfinite(x), torch.isposinf(x), torch.isneginf(x),
        torch.signbit(x), torch.frac(x), torch.square(x), torch.positive(x), torch.logit(unit.abs()),
    )


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_math_float(dtype):
    x = floats_with_ties(dtype, 8, 16)
    unit = (torch.rand(8, 16) * 1.98 - 0.99).to(dtype)
    pos = (torch.rand(8, 16) * 10 + 1e-3).to(dtype)
    assert_compiles_like_eager(_math, x, unit, pos)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_math_int(dtype):
    x = torch.randint(-5, 6, (4, 8), dtype=dtype)
    pos = torch.randint(1, 20, (4, 8), dtype=dtype)

    def fn(x, pos):
        return (torch.exp(x), torch.log(pos), torch.sqrt(pos), torch.rsqrt(pos), torch.sin(x), torch.erf(x),
                torch.sigmoid(x), torch.reciprocal(x), torch.tanh(x), torch.neg(x), torch.abs(x), torch.floor(x),
                torch.ceil(x), torch.round(x), torch.trunc(x), torch.sign(x), torch.isnan(x), torch.isinf(x),
                torch.isfinite(x), torch.signbit(x), torch.square(x), torch.nan_to_num(x), torch.exp2(x),
                torch.log2(pos), torch.atan(x), torch.relu(x))

    assert_compiles_like_eager(fn, x, pos)


def test_math_bool():
    b = torch.rand(4, 8) > 0.5
    assert_compiles_like_eager(lambda b: (torch.exp(b), torch.sqrt(b), torch.sigmoid(b), torch.sign(b), torch.isnan(b),
                                          torch.isinf(b), torch.isfinite(b), torch.nan_to_num(b), torch.cos(b),
                                          torch.reciprocal(b)), b)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_rounding_and_nan_to_num(dtype):
    x = floats_with_ties(dtype, 4, 16, scale=50.0)
    halves = (torch.arange(-8, 8) + 0.5).to(dtype)
    big = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0, -1.0, 3.0, 0.0, 2.0], dtype=dtype)

    def fn(x, halves, big):
        return (torch.round(halves), torch.round(x), torch.round(x, decimals=1), torch.round(x, decimals=2),
                torch.round(x, decimals=-1), torch.round(halves * 10, decimals=-1),
                torch.round(halves / 10, decimals=1),
                torch.floor(halves), torch.ceil(halves), torch.trunc(halves), torch.nan_to_num(big),
                torch.nan_to_num(big, nan=1.5, posinf=100.0, neginf=-100.0), torch.nan_to_num(big, posinf=2.0),
                torch.nan_to_num(x))

    assert_compiles_like_eager(fn, x, halves, big)


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "leaky_relu": F.leaky_relu,
    "leaky_relu_0.2": lambda x: F.leaky_relu(x, 0.2),
    "hardtanh": F.hardtanh,
    "hardtanh_range": lambda x: F.hardtanh(x, -0.5, 2.0),
    "relu6": F.relu6,
    "elu": F.elu,
    "elu_alpha": lambda x: F.elu(x, alpha=0.7),
    "selu": F.selu,
    "celu": lambda x: F.celu(x, alpha=1.3),
    "softplus": F.softplus,
    "softplus_beta": lambda x: F.softplus(x, beta=2.0, threshold=3.0),
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "mish": F.mish,
    "logsigmoid": F.logsigmoid,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "softsign": F.softsign,
    "tanhshrink": F.tanhshrink,
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_grad(name):
    x = torch.randn(4, 16) * 4
    x.view(-1)[:2] = torch.tensor([30.0, -30.0])  # saturated tails
    assert_compiles_like_eager(ACTIVATIONS[name], x, grad=True)


# Eager's vectorised erf-GELU returns NaN for +inf (its scalar path, and the math, give +inf); we give +inf.
_INF_DIFFERS = {"gelu"}


def _all_activations(x):
    finite = x.clamp(-1e4, 1e4)  # NaN stays NaN
    return tuple(f(finite if name in _INF_DIFFERS else x) for name, f in ACTIVATIONS.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_activations_low_precision(dtype):
    x = (torch.randn(4, 16) * 4).to(dtype)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), 30.0])
    assert_compiles_like_eager(_all_activations, x)


def test_activations_special_values():
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 100.0, -100.0, 6.0, 3.0, -3.0, 1.0, -1.0])
    assert_compiles_like_eager(_all_activations, x)
