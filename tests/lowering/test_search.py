"""Sorted search and binning (``rules/search.py``) against eager PyTorch: searchsorted, bucketize, isin,
histc, histogram, histogramdd and segment_reduce (forward and backward)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import assert_compiles_like_eager

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(int(os.environ.get("TPUCOMPILE_TEST_SEED", "0")))


# --- searchsorted / bucketize / isin ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_searchsorted(aten_ops, dtype):
    seq = torch.randint(-5, 5, (9,)).sort().values.to(dtype)  # ties: left and right sides differ
    batched = torch.randint(-5, 5, (3, 7)).sort(-1).values.to(dtype)
    values = torch.randint(-6, 6, (3, 4)).to(dtype)
    shuffled = torch.randperm(9)
    unsorted, sorter = seq[shuffled], shuffled.argsort()

    def fn(seq, batched, values, unsorted, sorter):
        return (
            torch.searchsorted(seq, values),
            torch.searchsorted(seq, values, right=True, out_int32=True),
            torch.searchsorted(batched, values, side="right"),
            torch.searchsorted(unsorted, values, sorter=sorter),
            torch.searchsorted(seq, 2),
            torch.bucketize(values, seq),
            torch.bucketize(values, seq, right=True),
        )

    assert_compiles_like_eager(fn, seq, batched, values, unsorted, sorter)
    ops = {aten.searchsorted.Tensor, aten.searchsorted.Scalar, aten.bucketize.Tensor}
    assert ops <= aten_ops


def test_searchsorted_nan_and_promotion():
    seq = torch.tensor([-1.0, 0.5, 2.0, float("nan"), float("nan")])  # NaNs sort last
    values = torch.tensor([float("nan"), -2.0, 0.5, 3.0, float("inf")])

    def fn(seq, values, ints, wanted):
        return (torch.searchsorted(seq, values), torch.searchsorted(seq, values, right=True),
                torch.searchsorted(ints, 2.5), torch.isin(values, seq), torch.isin(ints, wanted))

    assert_compiles_like_eager(fn, seq, values, torch.tensor([1, 2, 3, 4]), torch.tensor([2, 9]))


# --- histograms ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_histc(aten_ops, dtype):
    x = (torch.randn(40) * 3).to(dtype)
    x[:3] = torch.tensor([float("nan"), 10.0, -10.0])  # NaN and the range's own ends

    def fn(x, flat):
        return (torch.histc(x, bins=7, min=-10, max=10), torch.histc(x.nan_to_num(), bins=5),
                torch.histc(flat, bins=4))

    assert_compiles_like_eager(fn, x, torch.full((6,), 2.5, dtype=dtype))  # min == max: widened by 1
    assert aten.histc.default in aten_ops


def test_histogram(aten_ops):
    x = torch.randn(5, 8)
    weight = torch.rand(5, 8)
    edges = torch.tensor([-2.0, -0.5, 0.0, 0.3, 2.0])

    def fn(x, weight, edges, constant):
        return (torch.histogram(x, bins=6), torch.histogram(x, bins=3, range=(-1.0, 1.0), weight=weight),
                torch.histogram(x, bins=edges, density=True), torch.histogram(constant, bins=2))

    assert_compiles_like_eager(fn, x, weight, edges, torch.ones(4))  # equal extremes: widened by 0.5
    assert {aten.histogram.bin_ct, aten.histogram.bins_tensor} <= aten_ops


def test_histogramdd(aten_ops):
    points = torch.randn(20, 3)
    weight = torch.rand(20)
    edges = [torch.tensor([-1.0, 0.0, 1.0]), torch.tensor([-2.0, 2.0]), torch.tensor([-0.5, 0.0, 0.5, 3.0])]

    def fn(points, weight, e0, e1, e2):
        return (torch.histogramdd(points, bins=[2, 3, 4], weight=weight, density=True),
                torch.histogramdd(points, bins=[e0, e1, e2]),
                torch.histogramdd(points, bins=[3, 1, 2], range=[-1.0, 1.0, 0.0, 1.0, -2.0, 0.0]))

    assert_compiles_like_eager(fn, points, weight, *edges)
    assert aten._histogramdd_from_bin_cts.default in aten_ops


# --- segment_reduce -----------------------------------------------------------------------------------------


REDUCTIONS = ("sum", "mean", "max", "min", "prod")


def test_segment_reduce(aten_ops):
    data = torch.randn(7, 3)
    data[4, 1] = float("nan")
    lengths = torch.tensor([2, 0, 3, 2])
    offsets = torch.tensor([1, 3, 3, 6])  # element 0 and element 6 are in no segment

    def fn(data):
        return tuple(
            (torch.segment_reduce(data, r, lengths=lengths),
             torch.segment_reduce(data, r, offsets=offsets, initial=2.0),
             torch.segment_reduce(data.T, r, lengths=lengths.expand(3, 4), axis=1))
            for r in REDUCTIONS
        )

    assert_compiles_like_eager(fn, data)
    assert aten.segment_reduce.default in aten_ops


def test_segment_reduce_grad(aten_ops):
    data = torch.randn(8, 2)
    data[1] = data[0]  # a tie for max
    data[5, 0] = 0.0  # a zero for prod
    lengths = torch.tensor([3, 0, 4, 1])
    assert_compiles_like_eager(
        lambda d: tuple(torch.segment_reduce(d, r, lengths=lengths, initial=0.5) for r in REDUCTIONS), data,
        grad=True,
    )
    assert aten._segment_reduce_backward.default in aten_ops
