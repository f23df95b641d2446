"""Scan lowerings against eager PyTorch: cummax/cummin (``scans.py``), and cumsum/cumprod/logcumsumexp
(registered in ``reductions.py``) for the dtype rules and gradients.

Each test compiles one function with several ops to keep the compile count low, and checks with the
``aten_ops`` fixture that the ATen ops it is about reached the backend.
"""

from __future__ import annotations

import torch

from tests.support import assert_compiles_like_eager

aten = torch.ops.aten
NAN = float("nan")


def test_cummax_cummin_all_dims_with_grad(aten_ops):
    x = torch.randn(4, 6, 3)

    def fn(x):
        return [torch.cummax(x, d) for d in (0, 1, -1)] + [torch.cummin(x, d) for d in (0, 1, 2)]

    assert_compiles_like_eager(fn, x, grad=True)
    assert {aten.cummax.default, aten.cummin.default} <= aten_ops


def test_cummax_cummin_ties_and_nan(aten_ops):
    # Ties report the last index of the extreme; once a NaN is seen it sticks, with the last NaN's index.
    x = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, NAN, 5.0, NAN, 1.0],
            [1.0, 0.0, 0.0, 2.0, NAN, -5.0, NAN, 1.0],
            [-0.0, 0.0, -0.0, float("-inf"), float("-inf"), 2.0, 2.0, float("inf")],
        ]
    )

    def fn(x):
        return torch.cummax(x, 1), torch.cummin(x, 1), torch.cummax(x.bfloat16(), 1), torch.cummin(x, 0)

    assert_compiles_like_eager(fn, x)
    assert {aten.cummax.default, aten.cummin.default} <= aten_ops


def test_cummax_cummin_integers_bool_scalar():
    x = torch.randint(-3, 3, (5, 7))

    def fn(x):
        b = x > 0
        return (
            torch.cummax(x, 1),
            torch.cummin(x, 0),
            torch.cummax(b, 1),
            torch.cummin(b, 1),
            torch.cummax(x.to(torch.uint8), 1),
            torch.cummax(x.sum(), 0),
        )

    assert_compiles_like_eager(fn, x)


def test_cumsum_family_with_grad(aten_ops):
    x = torch.randn(3, 5, 2)

    def fn(x):
        return (
            [torch.cumsum(x, d) for d in (0, 1, -1)],
            torch.cumprod(x, 1),
            torch.logcumsumexp(x, 1),
            torch.logcumsumexp(x, 0),
        )

    assert_compiles_like_eager(fn, x, grad=True)
    assert {aten.cumsum.default, aten.cumprod.default, aten.logcumsumexp.default} <= aten_ops


def test_cumsum_dtypes(aten_ops):
    i = torch.randint(-5, 5, (4, 6))

    def fn(i, x):
        return (
            torch.cumsum(i, 1),  # int64
            torch.cumsum(i.int(), 0),  # int32 gives int64
            torch.cumsum(i > 0, 1),  # bool gives int64
            torch.cumsum(i, 1, dtype=torch.float32),
            torch.cumprod(i.int(), 1),
            torch.cumsum(x.bfloat16(), 1),
            torch.logcumsumexp(torch.tensor([[float("-inf"), float("-inf"), 0.0]]), 1),
        )

    out = assert_compiles_like_eager(fn, i, torch.randn(2, 9))
    assert [t.dtype for t in out[:4]] == [torch.int64, torch.int64, torch.int64, torch.float32]
    assert aten.cumsum.default in aten_ops
