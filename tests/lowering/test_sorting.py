"""Sorting and selection lowerings against eager PyTorch: sort/argsort, topk, kthvalue, median, nanmedian, mode.

Each test compiles one function with several ops to keep the compile count low, and checks with the
``aten_ops`` fixture that the ATen ops it is about reached the backend.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import assert_compiles_like_eager
from tpucompile import driver
from tpucompile.lowering.rules.sorting import TOPK_BY_REDUCTION

aten = torch.ops.aten
NAN, INF = float("nan"), float("inf")


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaNs (two in one row), infinities and a signed zero tie planted in it."""
    x = x.clone()
    x[1, 3] = x[2, 0] = x[2, 5] = NAN
    x[0, 2], x[4, 4] = INF, -INF
    x[3, 1], x[3, 2] = -0.0, 0.0
    return x


def test_sort_float_with_grad(aten_ops):
    x = torch.randn(5, 7)

    def fn(x):
        return torch.sort(x, dim=1, descending=True), torch.sort(x, dim=0).values * 2, torch.sort(x[0, 0])

    assert_compiles_like_eager(fn, x, grad=True)
    assert aten.sort.default in aten_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sort_nan_inf_and_ties(aten_ops, dtype):
    x = with_specials(torch.randn(5, 7)).to(dtype)

    def fn(x):
        return (
            torch.sort(x, dim=1),
            torch.sort(x, dim=0, descending=True),
            torch.sort(x, dim=1, descending=True, stable=True),
            torch.argsort(x, dim=1, descending=True),  # CompositeImplicit: reaches the backend as a sort
        )

    assert_compiles_like_eager(fn, x)
    assert {aten.sort.default, aten.sort.stable} <= aten_ops


def test_sort_integers_and_bool_are_stable():
    x = torch.randint(-3, 3, (5, 9))  # many ties: indices must follow the original order
    assert_compiles_like_eager(
        lambda x: (torch.sort(x, dim=1), torch.sort(x, dim=0, descending=True), torch.sort(x > 0, dim=1),
                   torch.sort(x.to(torch.uint8), dim=1, descending=True)),
        x,
    )


def test_topk_with_grad(aten_ops):
    x = torch.randn(4, 8)

    def fn(x):
        return torch.topk(x, 3, dim=1), torch.topk(x, 2, dim=0, largest=False), torch.topk(x, 1, sorted=False)

    assert_compiles_like_eager(fn, x, grad=True)
    assert aten.topk.default in aten_ops


def test_topk_nan_int_bf16(aten_ops):
    x = with_specials(torch.randn(5, 7))
    x[0, 1] = NAN  # NaN counts as the largest value

    def fn(x, i):
        return torch.topk(x, 2, dim=1).values, torch.topk(x.bfloat16(), 3, dim=0).values, torch.topk(i, 2).values

    assert_compiles_like_eager(fn, x, torch.randint(-50, 50, (3, 6)))
    assert aten.topk.default in aten_ops
    # Row 2's two NaNs (and row 3's signed zeros, when they make the top 2) tie: eager's kernel returns tied
    # elements in no specified order, which changes with the rest of the row; ours is the stable sort's.
    indices = torch.compile(lambda x: torch.topk(x, 2, dim=1).indices, backend="tpucompile")(x)
    assert torch.equal(indices, torch.sort(x, dim=1, descending=True, stable=True).indices[:, :2])


def test_topk_ties_come_lowest_index_first():
    """PyTorch's CPU topk returns tied values in an unspecified index order; ours puts lower indices first.
    The values match eager, and each index points at its value."""
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0, 1.0]])
    compiled = torch.compile(lambda x: torch.topk(x, 4), backend="tpucompile", fullgraph=True)
    values, indices = compiled(x)
    torch.testing.assert_close(values, torch.topk(x, 4).values)
    assert indices.tolist() == [[0, 2, 4, 3]]


def _programs_of(fn, *args):
    """The StableHLO text of every program compiling ``fn`` builds, and its result."""
    events = []
    remove = driver.add_observer(events.append)
    try:
        result = torch.compile(fn, backend="tpucompile", fullgraph=True)(*args)
    finally:
        remove()
    return [e.program.text(debug_info=False) for e in events], result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64])
@pytest.mark.parametrize("largest", [True, False])
def test_topk_by_reduction_equals_the_sorted_prefix(dtype, largest):
    """Small ``k`` takes the elements one reduction at a time, larger ``k`` sorts: both give the first ``k``
    of the stable sort (NaN largest, ties lowest index first), on rows full of ties, NaNs and infinities."""
    torch.manual_seed(0)
    if dtype.is_floating_point:
        x = with_specials(torch.randn(5, 7)).to(dtype)
        x[4, :3] = x[4, 3]  # a row of ties
        x[1, 5] = NAN  # and one with two NaNs
    else:
        x = torch.randint(-2, 3, (5, 7), dtype=dtype)
    small = TOPK_BY_REDUCTION

    def fn(x):
        return [torch.topk(x, k, dim=d, largest=largest) for k in (1, small, small + 1) for d in (0, 1)]

    texts, results = _programs_of(fn, x)
    order = [torch.sort(x, dim=d, descending=largest, stable=True) for d in (0, 1)]
    for (values, indices), k, d in zip(results, [1, 1, small, small, small + 1, small + 1], [0, 1] * 3, strict=True):
        expected_values, expected_indices = (t.narrow(d, 0, k) for t in order[d])
        torch.testing.assert_close(values, expected_values, equal_nan=True, rtol=0, atol=0)
        assert torch.equal(indices, expected_indices), (k, d)
    # one sort per call of k = small + 1 (two dims), none for the smaller ones
    assert sum(t.count("stablehlo.sort") for t in texts) == 2


def test_topk_of_a_long_row_by_reduction():
    x = torch.randn(3, 5000)
    x[1, 17] = x[1, 4000] = x.max() + 1  # a tie for first place
    texts, (values, indices) = _programs_of(lambda x: torch.topk(x, 3), x)
    expected = torch.sort(x, descending=True, stable=True)
    torch.testing.assert_close(values, expected.values[:, :3], rtol=0, atol=0)
    assert torch.equal(indices, expected.indices[:, :3])
    assert indices[1, :2].tolist() == [17, 4000]
    assert not any("stablehlo.sort" in t for t in texts)


def test_kthvalue_median_with_grad(aten_ops):
    x = torch.randn(4, 6)

    def fn(x):
        return torch.kthvalue(x, 2, dim=1), torch.median(x, dim=0), torch.median(x), torch.kthvalue(x, 4, 0)

    assert_compiles_like_eager(fn, x, grad=True)
    assert {aten.kthvalue.default, aten.median.dim, aten.median.default} <= aten_ops


def test_median_nanmedian_with_nans(aten_ops):
    x = with_specials(torch.randn(5, 7))
    x[4] = NAN  # a row of NaNs only: median gives its first index; nanmedian an unspecified one in eager

    def fn(x):
        return torch.median(x, dim=1), torch.nanmedian(x[:4], dim=1), torch.nanmedian(x[4], 0).values, \
            torch.median(x), torch.nanmedian(x[:4])

    assert_compiles_like_eager(fn, x)
    assert {aten.nanmedian.dim, aten.nanmedian.default} <= aten_ops


def test_median_integers():
    x = torch.tensor([[5, 1, 3, 9, 7, 2], [4, 8, 6, 0, 2, 1]])  # distinct per row: the index is unambiguous
    assert_compiles_like_eager(lambda x: (torch.median(x, dim=1), torch.kthvalue(x, 5, dim=1)), x)


def test_mode(aten_ops):
    x = torch.randint(-3, 3, (5, 9))  # ties in frequency: the smallest value, its last index
    f = torch.tensor([[1.0, 2.0, 2.0, 1.0, 3.0], [NAN, 1.0, NAN, 2.0, 2.0]])
    assert_compiles_like_eager(lambda x, f: (torch.mode(x, 1), torch.mode(x, 0), torch.mode(f, 1)), x, f)
    assert aten.mode.default in aten_ops
