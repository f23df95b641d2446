"""Tensors made from nothing: full/zeros/ones(-like), empty, arange, linspace, scalar_tensor."""

import pytest
import torch

from tests.support import assert_compiles_like_eager, compile_fn

# Seeded inputs; every op here must lower (conftest sets TPUCOMPILE_FALLBACK=error for the whole session).
pytestmark = pytest.mark.usefixtures("seeded")


def test_full_zeros_ones():
    x = torch.randn(3, 4)
    i = torch.randint(-5, 5, (2, 3), dtype=torch.int32)

    def fn(x, i):
        return (
            torch.full((2, 3), 1.5), torch.full((2,), 7), torch.full((3,), 2.7, dtype=torch.int64),
            torch.full((2, 2), float("nan")), torch.full((2,), float("-inf"), dtype=torch.bfloat16),
            torch.full((2,), True), torch.full((2,), 2**40), torch.full((), 3.25, dtype=torch.float16),
            torch.zeros(3), torch.zeros(2, 3, dtype=torch.int32), torch.zeros(4, dtype=torch.bool),
            torch.ones(2, dtype=torch.int32), torch.ones(3, dtype=torch.bool), torch.ones(2, 2, dtype=torch.bfloat16),
            torch.zeros_like(x), torch.ones_like(x), torch.zeros_like(i), torch.ones_like(i, dtype=torch.float16),
            torch.full_like(x, 7), torch.full_like(i, -3), torch.full_like(x, 0.5, dtype=torch.bfloat16),
            x.new_zeros(2, 5), x.new_ones(3), x.new_full((2,), -1.25), i.new_full((3,), 9), torch.zeros(0, 3),
            torch.ones(2, 0, dtype=torch.int64), x + torch.zeros(4), torch.full((2,), -1, dtype=torch.uint8),
        )

    assert_compiles_like_eager(fn, x, i)


def test_scalar_tensor():
    x = torch.randn(3)

    def fn(x):
        return (torch.scalar_tensor(3.0), torch.scalar_tensor(2, dtype=torch.int64), torch.scalar_tensor(True),
                torch.scalar_tensor(1.5, dtype=torch.bfloat16), x * torch.scalar_tensor(-2.0),
                torch.scalar_tensor(float("inf")))

    assert_compiles_like_eager(fn, x)


def test_empty_shape_and_dtype():
    """Values of ``empty`` are undefined: only the shape and dtype have to match."""
    x = torch.randn(3, 4)
    i = torch.randint(0, 5, (2, 3), dtype=torch.int32)

    def fn(x, i):
        return (torch.empty(3, 2), torch.empty(4, dtype=torch.int64), torch.empty_like(x), torch.empty_like(i),
                x.new_empty(5), torch.empty(2, 3, dtype=torch.bool), torch.empty_like(x.t()),
                torch.empty_strided((2, 3), (1, 2)), torch.empty(0))

    expected = fn(x, i)
    actual = compile_fn(fn)(x, i)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert (a.shape, a.dtype) == (e.shape, e.dtype)


ARANGES = [
    (5,), (0,), (1, 10), (1, 10, 2), (10, 1, -1), (5, -3, -2), (-7, 8, 3), (0, 1, 0.1), (1.5, 4.5), (0.5, 3.7, 0.4),
    (3.0, -1.0, -0.25), (2.5,), (-1, 1, 0.3),
]


def test_arange():
    x = torch.randn(3)

    def fn(x):
        outs = [torch.arange(*args) for args in ARANGES]
        outs += [torch.arange(5, dtype=torch.float32), torch.arange(1, 6, dtype=torch.bfloat16),
                 torch.arange(0, 2, 0.25, dtype=torch.float16), torch.arange(3, dtype=torch.int32),
                 torch.arange(0, 5, 1.5, dtype=torch.int64), torch.arange(1000, 1100, 7.5),
                 torch.arange(-2.0, 2.0, 0.5, dtype=torch.bfloat16), torch.arange(3) + x]
        return tuple(outs)

    assert_compiles_like_eager(fn, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_linspace_logspace(dtype):
    x = torch.randn(3)

    def fn(x):
        outs = (torch.linspace(0, 1, 7, dtype=dtype), torch.linspace(-2, 5, 5, dtype=dtype),
                torch.linspace(3, -3, 4, dtype=dtype), torch.linspace(2, 2, 1, dtype=dtype),
                torch.linspace(0, 10, 0, dtype=dtype), torch.linspace(-1, 20, 8, dtype=dtype))
        if dtype.is_floating_point:
            outs += (torch.logspace(0, 2, 4, dtype=dtype), torch.logspace(-1, 1, 5, base=2.0, dtype=dtype),
                     torch.linspace(0.5, 1.5, 3, dtype=dtype) * x)
        return outs

    assert_compiles_like_eager(fn, x)
