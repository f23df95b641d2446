"""Matrix products against eager PyTorch: every matmul entry point, broadcasting, dtypes and gradients."""

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager


# Low-precision products accumulate in f32 and round once, as eager's CPU kernels do: default tolerances.
@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _products(a, b, c, v, bias):
    return (
        a @ b,
        torch.mm(a, b),
        torch.addmm(bias, a, b),
        torch.addmm(bias[0], a, b, beta=0.5, alpha=2.0),
        torch.addmm(bias, a, b, beta=0.0, alpha=-1.5),
        torch.mv(a, v),
        a @ v,
        v @ b,
        v @ v,
        torch.dot(v, v * 2),
        torch.bmm(c, b.expand(2, 16, 5)),
        torch.baddbmm(c[:, :, :5], c, b.expand(2, 16, 5), beta=0.25, alpha=3.0),
        torch.baddbmm(bias[:3], c, b.expand(2, 16, 5)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mm_addmm_bmm(dtype):
    args = [
        torch.randn(3, 16),
        torch.randn(16, 5),
        torch.randn(2, 3, 16),
        torch.randn(16),
        torch.randn(3, 5),
    ]
    # Gradients in f32 only: in bf16/f16 each input's gradient here is a sum of a dozen rounded products
    # that cancel, and eager adds them in another order; test_low_precision_gradients covers the backward.
    assert_compiles_like_eager(_products, *(t.to(dtype) for t in args), grad=dtype is torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_gradients(dtype):
    def fn(x, w, b, c):
        return F.linear(x, w, b), torch.bmm(c, c.transpose(1, 2))

    args = [torch.randn(4, 3, 16), torch.randn(8, 16), torch.randn(8), torch.randn(2, 3, 16)]
    assert_compiles_like_eager(fn, *(t.to(dtype) for t in args), grad=True)


def test_addmm_beta_zero_ignores_nan_bias():
    def fn(bias, a, b):
        batched = torch.baddbmm(bias.expand(2, 3, 5), a.expand(2, 3, 4), b.expand(2, 4, 5), beta=0)
        return torch.addmm(bias, a, b, beta=0), batched

    bias = torch.full((3, 5), float("nan"))
    assert_compiles_like_eager(fn, bias, torch.randn(3, 4), torch.randn(4, 5))


def test_matmul_broadcasting():
    def fn(v, m, b3, b4, w):
        return (
            v @ v,  # 1-D @ 1-D: a scalar
            v @ b3,  # 1-D @ 3-D: prepended 1 removed
            b3 @ w[:, 0],  # 3-D @ 1-D
            m @ b3,  # 2-D @ 3-D: the matrix broadcasts over the batch
            b3 @ w,  # 3-D @ 2-D: folded into one mm
            b4 @ b3.transpose(-1, -2)[:, :, :2].unsqueeze(1),  # batch [3, 2] against [3, 1]
            torch.matmul(b4, b4.transpose(-1, -2)),
            b4[:2, :1] @ (w * b3[:, :1, :1]).unsqueeze(0),  # batch [2, 1] against [1, 3]
        )

    assert_compiles_like_eager(
        fn,
        torch.randn(4),
        torch.randn(6, 4),
        torch.randn(3, 4, 5),
        torch.randn(3, 2, 6, 5),
        torch.randn(5, 7),
        grad=True,
    )


def test_linear_and_einsum():
    def fn(x, w, b, q, k):
        return (
            F.linear(x, w, b),
            F.linear(x, w),
            F.linear(x[0, 0], w, b),
            torch.einsum("bij,bjk->bik", x, w.t().expand(2, 8, 6)),
            torch.einsum("i,j->ij", b, x[0, 0]),
            torch.einsum("bhqd,bhkd->bhqk", q, k),
            torch.einsum("bhqk,bhkd->bqhd", q @ k.transpose(-1, -2), k),
            torch.einsum("ii->i", w[:, :6]),
            torch.einsum("bij->bj", x),
        )

    assert_compiles_like_eager(
        fn,
        torch.randn(2, 3, 8),
        torch.randn(6, 8),
        torch.randn(6),
        torch.randn(2, 2, 3, 4),
        torch.randn(2, 2, 5, 4),
        grad=True,
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_integer_matmul(dtype):
    def fn(a, b, c, bias):
        return a @ b, torch.bmm(c, c.transpose(1, 2)), torch.addmm(bias, a, b, beta=2, alpha=3), c @ b[:5, :2]

    ints = dict(dtype=dtype)
    assert_compiles_like_eager(
        fn,
        torch.randint(-9, 9, (3, 5), **ints),
        torch.randint(-9, 9, (5, 4), **ints),
        torch.randint(-9, 9, (2, 4, 5), **ints),
        torch.randint(-9, 9, (4,), **ints),
    )


def test_matmul_of_mixed_results_trains_like_eager():
    """A two-layer MLP step: products feeding products, with every gradient checked."""

    def fn(x, w1, b1, w2):
        hidden = torch.tanh(F.linear(x, w1, b1))
        return (hidden @ w2).sum(-1), hidden.transpose(-1, -2) @ hidden

    assert_compiles_like_eager(
        fn, torch.randn(4, 3, 8), torch.randn(16, 8), torch.randn(16), torch.randn(16, 2), grad=True,
        atol=5e-5, rtol=1e-4,  # gradients through two products and tanh: f32 sums in another order
    )
