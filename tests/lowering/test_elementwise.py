"""Binary arithmetic, comparisons, logical/bitwise ops, where, clamp, casts and type promotion vs eager."""

import pytest
import torch

from tests.support import EDGE_VALUES, assert_compiles_like_eager, floats, ints

# Seeded inputs; every op here must lower (conftest sets TPUCOMPILE_FALLBACK=error for the whole session).
pytestmark = pytest.mark.usefixtures("seeded")


FLOATS = [torch.float32, torch.bfloat16, torch.float16]
INTS = [torch.int32, torch.int64]
def _divisors(a, b):
    """Exact multiples with both signs, so that floor/trunc/remainder hit their boundary cases."""
    b = b.clone()
    b.view(-1)[:4] = torch.tensor([3, -3, 3, -3], dtype=b.dtype)
    a = a.clone()
    a.view(-1)[-4:] = torch.tensor([-6, 6, 7, -7], dtype=a.dtype)
    return a, b


def _arith(a, b):
    return (
        a + b,
        torch.add(a, b, alpha=2),
        a - b,
        torch.sub(a, b, alpha=4),  # a power of two: eager's f16 kernels round 3 * b first
        torch.rsub(a, b),
        a * b,
        torch.div(a, b, rounding_mode="trunc"),
        torch.div(a, b, rounding_mode="floor"),
        a // b,
        a % b,
        torch.fmod(a, b),
        torch.maximum(a, b),
        torch.minimum(a, b),
    )


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_binary_tensor_tensor(dtype):
    if dtype.is_floating_point:
        a, b = floats(dtype, 4, 8), floats(dtype, 8, specials=False)
        a.view(-1)[-12:-8] = torch.tensor([5.0, -5.0, 1e-3, -1e-3], dtype=dtype)  # small quotients
        b_full = floats(dtype, 4, 8).flip(1)  # specials against specials, for div/mod/max
        fn = lambda a, b, c: (*_arith(a, b), *_arith(a, c), a / b, a / c, torch.atan2(a, c))  # noqa: E731
    else:
        a, b = _divisors(ints(dtype, 4, 8), ints(dtype, 8, nonzero=True))
        b_full = ints(dtype, 4, 8, nonzero=True)
        fn = lambda a, b, c: (*_arith(a, b), *_arith(a, c), a / b)  # noqa: E731
    assert_compiles_like_eager(fn, a, b, b_full)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_binary_tensor_scalar(dtype):
    if dtype.is_floating_point:
        a = floats(dtype, 4, 8)

        def fn(a):
            return (a + 2.5, a - 3, 2 * a, a / 3, a / -0.0, 1 - a, torch.add(a, 3, alpha=2), a // 2.5, a // -2.5,
                    a % -3, a % 2.5, torch.fmod(a, -3), torch.fmod(a, 2.5), torch.div(a, 3, rounding_mode="trunc"),
                    torch.div(a, -3, rounding_mode="floor"), 7.0 / a, 3 % a)
    else:
        a = ints(dtype, 4, 8)

        def fn(a):
            return (a + 2, a - 3, a * -2, a / 3, 1 - a, torch.add(a, 3, alpha=2), a // 3, a // -3, a % -3, a % 3,
                    torch.fmod(a, -3), torch.fmod(a, 3), torch.div(a, 4, rounding_mode="trunc"),
                    torch.div(a, -4, rounding_mode="floor"), a + 2.5, a * 0.5, a // 2.5, a % 2.5)
    assert_compiles_like_eager(fn, a)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_pow_float(dtype):
    x = floats(dtype, 4, 8, scale=2.0)
    y = floats(dtype, 4, 8, scale=2.0).flip(0)
    pos = x.abs() + 0.5

    def fn(x, y, pos):
        return (x**2, x**3, x**0.5, x**-1, x**-2, x**-0.5, x**2.5, x**0, x**1, torch.pow(x, y), torch.pow(pos, y),
                2**x, 0.5**x, (-2.0) ** y, pos**x, torch.square(x))

    assert_compiles_like_eager(fn, x, y, pos)


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_pow_int(dtype):
    x = ints(dtype, 4, 8, low=-6, high=7)
    e = ints(dtype, 4, 8, low=0, high=6)
    neg = torch.tensor([[-1, -2, -3, -1, -2, -3, 0, 0]], dtype=dtype)
    base = torch.tensor([[1, -1, -1, 2, -2, 0, 1, 5]], dtype=dtype)

    def fn(x, e, neg, base):
        return (x**2, x**3, x**0, torch.pow(x, e), 2**e, 3**x.abs(), x**0.5, x**2.0, 2.5**x, torch.pow(base, neg),
                torch.square(x))

    assert_compiles_like_eager(fn, x, e, neg, base)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_maximum_minimum_nan(dtype):
    a = torch.tensor([float("nan"), 1.0, float("nan"), -0.0, float("-inf"), 2.0], dtype=dtype)
    b = torch.tensor([1.0, float("nan"), float("nan"), 0.0, 3.0, float("inf")], dtype=dtype)
    assert_compiles_like_eager(lambda a, b: (torch.maximum(a, b), torch.minimum(a, b), torch.fmax(a, b),
                                             torch.fmin(a, b)), a, b)


def test_atan2_quadrants():
    y = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0, -1.0, 0.0, -0.0, float("inf"), float("nan"), 3.0])
    x = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0, -1.0, -1.0, float("inf"), 1.0, float("-inf")])
    i = torch.tensor([1, -2, 3, 0, -5, 6, 7, 8, 9, 10, 11])
    assert_compiles_like_eager(lambda y, x, i: (torch.atan2(y, x), torch.atan2(i, i.flip(0))), y, x, i)


COMPARISON_DTYPES = FLOATS + INTS + [torch.bool]


def _sample(dtype, *shape):
    if dtype is torch.bool:
        return torch.rand(*shape) > 0.5
    if dtype.is_floating_point:
        return floats(dtype, *shape, scale=2.0).round()  # small integers: ties happen
    return ints(dtype, *shape, low=-3, high=4)


@pytest.mark.parametrize("dtype", COMPARISON_DTYPES, ids=str)
def test_comparisons(dtype):
    a, b = _sample(dtype, 4, 8), _sample(dtype, 8)
    f = floats(torch.float32, 4, 8, scale=2.0).round()

    def fn(a, b, f):
        return (a == b, a != b, a < b, a <= b, a > b, a >= b, a == 1, a != 0, a < 1, a <= 0, a > 0.5, a >= -1.5,
                a < f, a == f, a >= f, torch.eq(a, 2), torch.gt(a, True))

    assert_compiles_like_eager(fn, a, b, f)


def test_comparisons_mixed_dtypes():
    i32 = ints(torch.int32, 8, low=-3, high=3)
    i64 = ints(torch.int64, 8, low=-3, high=3)
    bf = floats(torch.bfloat16, 8).round()
    f = floats(torch.float32, 8).round()
    big = torch.tensor([16777217, 16777216, 2**31 - 1, -(2**31), 3, -3, 0, 1], dtype=torch.int32)

    one, quarter = torch.tensor(1), torch.tensor(0.25)

    def fn(i32, i64, bf, f, big, one, quarter):
        return (i32 < i64, i32 == bf, bf >= f, f != i64, i32 > 1.5, bf == 0.5, big == big.float(), big.float() > big,
                i64 <= one, bf < quarter, i32 >= quarter, one == quarter)

    assert_compiles_like_eager(fn, i32, i64, bf, f, big, one, quarter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.bool], ids=str)
def test_logical(dtype):
    a = _sample(dtype, 4, 8)
    if dtype.is_floating_point:
        a.view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=dtype)
    b = _sample(dtype, 8)
    f = floats(torch.float32, 4, 8).round()

    def fn(a, b, f):
        return (torch.logical_and(a, b), torch.logical_or(a, b), torch.logical_xor(a, b), torch.logical_not(a),
                torch.logical_and(a, f), torch.logical_xor(f, a), torch.logical_not(f))

    assert_compiles_like_eager(fn, a, b, f)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool], ids=str)
def test_bitwise(dtype):
    if dtype is torch.bool:
        a, b = _sample(dtype, 4, 8), _sample(dtype, 8)

        def fn(a, b):
            return a & b, a | b, a ^ b, ~a, a & True, a | False, a ^ True, a & (b > 0)
    else:
        a, b = ints(dtype, 4, 8, low=-1000, high=1000), ints(dtype, 8, low=-1000, high=1000)

        def fn(a, b):
            return a & b, a | b, a ^ b, ~a, a & 0xF0, a | 3, a ^ -1, ~(a & b)
    assert_compiles_like_eager(fn, a, b)


def test_bool_arithmetic_and_promotion():
    a, b = _sample(torch.bool, 4, 8), _sample(torch.bool, 8)
    i = ints(torch.int32, 4, 8)
    assert_compiles_like_eager(lambda a, b, i: (a + b, a * b, a + 1, a * 2.5, a + i, i - a.int(), a / 2, a + 1.5,
                                                torch.maximum(a, b), torch.minimum(a, b)), a, b, i)


def test_where():
    cond = torch.rand(4, 1) > 0.5
    cond_full = torch.rand(4, 8) > 0.5
    x = floats(torch.float32, 4, 8)
    y = floats(torch.float32, 8)
    i = ints(torch.int64, 4, 8)
    h = floats(torch.bfloat16, 4, 8)

    def fn(cond, cond_full, x, y, i, h):
        return (torch.where(cond, x, y), torch.where(cond_full, x, 0.0), torch.where(cond, 1.5, x),
                torch.where(cond_full, 1, 2), torch.where(cond_full, 1.0, 2), torch.where(cond, i, 2.5),
                torch.where(cond, x, i), torch.where(cond, h, x), torch.where(cond, h, 3.0),
                torch.where(cond_full, i, -1),
                torch.where(x > 0, x, y), torch.where(cond_full, torch.tensor(2.0), i), x.masked_fill(cond, -1.0),
                torch.where(cond_full, cond_full, False))

    assert_compiles_like_eager(fn, cond, cond_full, x, y, i, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64], ids=str)
def test_clamp(dtype):
    if dtype.is_floating_point:
        x = floats(dtype, 4, 8)
        lo, hi = floats(dtype, 8, specials=False) - 1, floats(dtype, 4, 1, specials=False) + 1
        lo[-1] = float("nan")  # a NaN bound gives NaN, as a NaN input does

        def fn(x, lo, hi):
            return (torch.clamp(x, -1, 1), torch.clamp(x, min=-0.5), torch.clamp(x, max=0.25), torch.clamp_min(x, 0.2),
                    torch.clamp_max(x, -0.2), torch.clamp(x, lo, hi), torch.clamp(x, min=lo), torch.clamp(x, max=hi),
                    torch.clamp_min(x, lo), torch.clamp_max(x, hi), torch.clamp(x, 1, -1), x.clamp(-2.5, 2.5))
    else:
        x = ints(dtype, 4, 8)
        lo, hi = ints(dtype, 8, low=-10, high=0), ints(dtype, 4, 1, low=0, high=10)

        def fn(x, lo, hi):
            return (torch.clamp(x, -5, 5), torch.clamp(x, min=0), torch.clamp(x, max=3), torch.clamp(x, lo, hi),
                    torch.clamp_min(x, lo), torch.clamp_max(x, hi), torch.clamp(x, min=0.5), torch.clamp(x, -2.5, 2.5),
                    torch.clamp(x, 5, -5), torch.clamp(x, min=lo.float()))
    assert_compiles_like_eager(fn, x, lo, hi)


def test_casts():
    x = floats(torch.float32, 4, 8, specials=False)
    x.view(-1)[:8] = torch.tensor([-2.7, 2.7, -0.5, 0.5, 1e5, -1e5, 3.0e38, 1.00000012])
    nan = floats(torch.float32, 4, 8)
    i64 = torch.tensor([0, 1, -1, 2**24 + 1, -(2**40) - 1, 2**62, 123456789, -7])
    b = torch.rand(4, 8) > 0.5
    bf = floats(torch.bfloat16, 4, 8)
    h = floats(torch.float16, 4, 8)

    def fn(x, nan, i64, b, bf, h):
        small, tiny = x.clamp(-1e4, 1e4), x.clamp(-100, 100)
        return (small.int(), small.long(), small.to(torch.int16), tiny.to(torch.int8), x.bool(), nan.bool(),
                b.float(), b.long(), b.int(), b.to(torch.bfloat16), i64.float(), i64.int(), i64.bool(), i64.half(),
                i64.to(torch.bfloat16), x.bfloat16(), x.half(), nan.bfloat16(), nan.half(), bf.float(), h.float(),
                bf.half(), h.bfloat16(), bf.bool(), small.bfloat16().int(), small.half().long(), x.to(torch.float32),
                x.double().float(), i64.to(torch.uint8), tiny.abs().to(torch.uint8))

    assert_compiles_like_eager(fn, x, nan, i64, b, bf, h)


def test_type_promotion():
    i32 = ints(torch.int32, 4, 8)
    i64 = ints(torch.int64, 4, 8)
    den = ints(torch.int64, 4, 8, low=-5, high=5)  # zeros included: int / int is true division
    b = torch.rand(4, 8) > 0.5
    bf = floats(torch.bfloat16, 4, 8, specials=False)
    h = floats(torch.float16, 4, 8, specials=False)
    f = floats(torch.float32, 4, 8, specials=False)
    zero_i64 = torch.tensor(7)
    zero_f32 = torch.tensor(1.25)
    zero_f64 = torch.tensor(0.1, dtype=torch.float64)

    def fn(i32, i64, den, b, bf, h, f, zero_i64, zero_f32, zero_f64):
        return (i32 + 2.5, i64 * 0.5, b + 3, b + i32, i32 + zero_i64, i32 * zero_f32, bf + zero_f32, bf * zero_f64,
                h + zero_f32, f + zero_f64, i64 / den, i32 / 3, torch.true_divide(i64, 2), bf + h, bf + f, i32 + i64,
                h * i64, b * 1.5, bf + 1, i32 + bf, i32 + True, zero_i64 + zero_f32, b / b.int().clamp(min=1))

    assert_compiles_like_eager(fn, i32, i64, den, b, bf, h, f, zero_i64, zero_f32, zero_f64)


# --- floating-point bit manipulation ------------------------------------------------------------------------

SUBNORMALS = [1e-40, -3e-42, 1e-45, -1e-45, 1.17e-38, 3.0e38]


def _with_subnormals(dtype, *shape):
    x = floats(torch.float32, *shape)
    x.view(-1)[len(EDGE_VALUES) : len(EDGE_VALUES) + len(SUBNORMALS)] = torch.tensor(SUBNORMALS)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_copysign_nextafter_frexp(aten_ops, dtype):
    """Bit-exact: signs of NaN and -0.0, steps from 0 into the subnormals, subnormal mantissas."""
    a = _with_subnormals(dtype, 6, 5)
    b = floats(dtype, 6, 5).flip(0)
    b.view(-1)[-3:] = a.view(-1)[-3:]  # nextafter(x, x) == x

    def fn(a, b):
        mantissa, exponent = torch.frexp(a)
        return torch.copysign(a, b), torch.copysign(a, -1.5), torch.nextafter(a, b), mantissa, exponent

    assert_compiles_like_eager(fn, a, b, atol=0, rtol=0)
    ops = {torch.ops.aten.copysign.Tensor, torch.ops.aten.copysign.Scalar, torch.ops.aten.nextafter.default,
           torch.ops.aten.frexp.Tensor}
    assert ops <= aten_ops


def test_copysign_int_promotes_and_grad():
    assert_compiles_like_eager(torch.copysign, ints(torch.int64, 4, 5), ints(torch.int32, 4, 5))
    assert_compiles_like_eager(torch.copysign, floats(torch.float32, 4, 5, specials=False),
                               floats(torch.float32, 4, 5, specials=False), grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hypot_ldexp_angle(aten_ops, dtype):
    a, b = floats(dtype, 6, 5), floats(dtype, 6, 5).flip(1)
    big = (torch.randn(6, 5) * 1e30).to(dtype)  # a * a would overflow
    exponent = ints(torch.int64, 6, 5, low=-30, high=30)

    def fn(a, b, big, exponent):
        return (torch.hypot(a, b), torch.hypot(big, big.flip(0)), torch.ldexp(a, exponent), torch.ldexp(a, b),
                torch.angle(a), torch.angle(exponent))

    assert_compiles_like_eager(fn, a, b, big, exponent)
    ops = {torch.ops.aten.hypot.default, torch.ops.aten.ldexp.Tensor, torch.ops.aten.angle.default}
    assert ops <= aten_ops


def test_hypot_ldexp_angle_frexp_grad():
    a, b = floats(torch.float32, 4, 5, specials=False), floats(torch.float32, 4, 5, specials=False)

    def fn(a, b):
        return torch.hypot(a, b), torch.ldexp(a, b.clamp(-3, 3)), torch.angle(a) + a, torch.frexp(b)[0]

    assert_compiles_like_eager(fn, a, b, grad=True)


def test_addcmul_with_a_value_and_a_compiled_adam_step():
    """Dynamo writes ``addcmul_(t1, t2, value=v)`` as Inductor's ``prims.fma`` (every Adam step does it): lowered
    as its eager implementation, and three compiled AdamW steps equal eager ones."""
    def fn(x, a, b):
        x = x.clone()
        x.addcmul_(a, b, value=0.25)
        return x

    assert_compiles_like_eager(fn, torch.randn(5, 3), torch.randn(5, 3), torch.randn(3))
    torch.manual_seed(0)
    eager = torch.nn.Linear(6, 4)
    compiled = torch.nn.Linear(6, 4)
    compiled.load_state_dict(eager.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    step = torch.compile(optimizers[1].step, backend="tpucompile")
    for _ in range(3):
        x = torch.randn(8, 6)
        for model in (eager, compiled):
            model.zero_grad()
            model(x).square().mean().backward()
        optimizers[0].step()
        step()
    for expected, actual in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
