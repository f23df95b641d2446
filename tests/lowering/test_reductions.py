"""Reductions and scans against eager PyTorch: result dtypes, dims/keepdim, NaN and tie semantics, gradients."""

import pytest
import torch

from tests.support import assert_compiles_like_eager, small_ints

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sum_mean(dtype):
    def fn(x):
        return (
            x.sum(),
            x.sum(1),
            x.sum((0, -1), keepdim=True),
            x.sum(-2, dtype=torch.float32),
            x.sum([]),  # an empty dim list reduces everything
            x.mean(),
            x.mean(-1),
            x.mean((2, 0), keepdim=True),
            x.mean(1, dtype=torch.float32),
            x.sum(0).mean(0),
        )

    assert_compiles_like_eager(fn, torch.randn(4, 6, 8, dtype=dtype), grad=True)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_integer_sum_prod(dtype):
    def fn(x):
        return (
            x.sum(),  # int64 for every integer and bool input
            x.sum(1),
            x.sum(0, keepdim=True),
            x.sum(1, dtype=torch.int32),
            x.sum(dtype=torch.float32),
            x.prod(1),
            x.prod(),
            x.mean(-1, dtype=torch.float32),
        )

    low = 0 if dtype is torch.uint8 else -5
    x = (torch.rand(4, 5) > 0.5) if dtype is torch.bool else small_ints(dtype, 4, 5, low=low)
    assert_compiles_like_eager(fn, x)


def test_float64_accumulation():
    def fn(x):
        return x.sum(dtype=torch.float64), x.double().mean(0), x.double().var(1)

    assert_compiles_like_eager(fn, torch.randn(5, 7), grad=True)


def test_max_min_and_nan():
    def fn(x):
        return (
            x.amax((0, 1)),
            x.amin(-1),
            x.amax(),
            x.max(),
            x.min(),
            *x.max(1),
            *x.min(-1, keepdim=True),
            *torch.max(x, 0),
        )

    assert_compiles_like_eager(fn, torch.randn(4, 6, 8), grad=True)
    x = torch.randn(4, 6, 8)
    x[1, 2, 3] = NAN  # NaN wins max and min, and its index is returned
    x[2, :, 0] = INF
    x[3, 0, :] = -INF
    assert_compiles_like_eager(fn, x)


def test_max_min_integers_and_bool():
    def fn(x, b):
        return x.amax(1), x.amin(0), x.max(), *x.max(1), *x.min(0), b.amax(1), b.amin(0), b.any(1), b.all()

    assert_compiles_like_eager(fn, small_ints(torch.int32, 5, 6, low=-3, high=3), torch.rand(5, 6) > 0.3)


def test_argmax_argmin():
    def fn(x):
        return (
            x.argmax(),
            x.argmin(),
            x.argmax(1),
            x.argmin(-1, keepdim=True),
            x.argmax(0, keepdim=True),
            torch.argmax(x, dim=None, keepdim=True),
        )

    ties = torch.randint(0, 3, (5, 6)).float()  # many ties: the first index wins
    assert_compiles_like_eager(fn, ties)
    with_nan = torch.randn(5, 6)
    with_nan[1, 4] = NAN
    with_nan[1, 2] = NAN  # the first NaN of the row
    with_nan[3, 0] = INF
    with_nan[4, 5] = -INF
    assert_compiles_like_eager(fn, with_nan)
    assert_compiles_like_eager(fn, small_ints(torch.int64, 5, 6, low=-2, high=2))


def test_prod():
    def fn(x):
        return x.prod(1), x.prod(), x.prod(-1, keepdim=True), x.prod(0, dtype=torch.float64)

    x = torch.rand(3, 5) + 0.5
    assert_compiles_like_eager(fn, x, grad=True)
    x[1, 2] = 0.0  # prod's gradient has a special case for a single zero
    assert_compiles_like_eager(fn, x, grad=True)


@pytest.mark.filterwarnings("ignore:var\\(\\)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_var_std(dtype):
    def fn(x):
        return (
            x.var(1),
            x.var(unbiased=False),
            x.var((0, 2), correction=0, keepdim=True),
            x.std(-1),
            x.std((0, 1), correction=0),
            torch.var(x, 1, correction=2),
            *torch.var_mean(x, 1),
            *torch.var_mean(x, (0, -1), correction=0, keepdim=True),
            *torch.std_mean(x, -1),
            x[:, :1].var(1),  # a single element with correction 1: NaN, as in eager
        )

    assert_compiles_like_eager(fn, torch.randn(4, 6, 8, dtype=dtype) * 3 + 1, grad=True)


def test_any_all():
    def fn(x, i):
        return (
            x.any(),
            x.all(1),
            (x > 0).any(-1),
            (x > 0).all((0, 1)),
            (x > 0).any(0, keepdim=True),
            i.any(1),
            i.all(),
            i.bool().all(0),
        )

    x = torch.randn(4, 5, 6)
    x[0] = 0.0
    x[1, 2, 3] = NAN  # NaN is true
    assert_compiles_like_eager(fn, x, small_ints(torch.int32, 4, 5, low=0, high=3))


def test_logsumexp():
    def fn(x):
        return x.logsumexp(1), x.logsumexp((0, 2)), x.logsumexp(-1, keepdim=True)

    x = torch.randn(4, 6, 8) * 10
    assert_compiles_like_eager(fn, x, grad=True)
    x[0, :, 1] = -INF  # a whole -inf slice gives -inf, not NaN
    x[1, 2, :] = INF
    assert_compiles_like_eager(fn, x)


def test_cumsum_cumprod_floats():
    def fn(x):
        return (
            x.cumsum(1),
            x.cumsum(-1),
            x.cumprod(0),
            x.cumprod(-1),
            x.cumsum(0, dtype=torch.float64),
            x[0, 0].cumsum(0),
            x[0, 0, 0].cumsum(0),  # 0-d
        )

    assert_compiles_like_eager(fn, torch.rand(5, 37, 3) + 0.5, grad=True)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.bfloat16], ids=str)
def test_cumsum_cumprod_dtypes(dtype):
    def fn(x):
        return x.cumsum(0), x.cumsum(1), x.cumprod(1), x.cumsum(1, dtype=torch.float32), x.cumprod(0, dtype=torch.int64)

    if dtype is torch.bool:
        x = torch.rand(6, 17) > 0.3
    elif dtype.is_floating_point:
        x = (torch.rand(6, 17) + 0.5).to(dtype)
    else:
        x = small_ints(dtype, 6, 17, low=-3, high=4)
    assert_compiles_like_eager(fn, x)


def test_integer_cumprod_wraps_like_eager():
    def fn(x):
        return x.cumprod(0), x.cumsum(0)

    assert_compiles_like_eager(fn, torch.full((70, 2), 3, dtype=torch.int64))


def test_logcumsumexp():
    def fn(x):
        return torch.logcumsumexp(x, 1), torch.logcumsumexp(x, 0)

    x = torch.randn(4, 9) * 5
    assert_compiles_like_eager(fn, x, grad=True)
    x[1, :4] = -INF
    x[2, 3:5] = INF  # inf then inf: inf, not inf - inf = NaN
    x[3, 6] = float("nan")
    assert_compiles_like_eager(fn, x)


def test_norms():
    def fn(x):
        return (
            x.norm(),
            x.norm(p=1, dim=1),
            x.norm(p=float("inf"), dim=-1),
            x.norm(p=3, dim=(0, 2), keepdim=True),
            torch.linalg.vector_norm(x, 2, (0, 1)),
            torch.linalg.vector_norm(x, float("-inf"), 1),
            torch.linalg.vector_norm(x, 0, -1),
            torch.linalg.vector_norm(x, 2, -1, dtype=torch.float64),
            torch.nn.functional.normalize(x, dim=-1),
        )

    assert_compiles_like_eager(fn, torch.randn(4, 6, 8), grad=True)


def test_bfloat16_reductions():
    def fn(x):
        return (
            x.sum(1),
            x.mean(0),
            x.amax(1),
            x.var(1),
            x.norm(dim=-1),
            x.logsumexp(-1),
            x.prod(-1),
            x.argmax(1),
            x.cumsum(1),
        )

    assert_compiles_like_eager(fn, (torch.rand(8, 64) + 0.5).to(torch.bfloat16), grad=True)


def test_arg_extremes_of_a_zero_dim_tensor():
    x = torch.tensor(2.5)
    assert_compiles_like_eager(lambda x: (x.argmax(0, True), x.argmin(0), x.argmax(), x.argmin(-1)), x)
