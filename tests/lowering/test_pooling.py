"""Pooling lowerings against eager PyTorch, end to end through ``torch.compile`` with gradients.

1d pooling reaches the backend as the 2d op on an unsqueezed input; the ``aten_ops`` fixture checks that each
test exercised the forward and backward ops it is about. Max pooling returns its indices too, which must be
PyTorch's exactly (flat into the input plane; ties to the first element, NaN wins).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager

aten = torch.ops.aten

MAX_2D = {aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default}
MAX_3D = {aten.max_pool3d_with_indices.default, aten.max_pool3d_with_indices_backward.default}
AVG_2D = {aten.avg_pool2d.default, aten.avg_pool2d_backward.default}
AVG_3D = {aten.avg_pool3d.default, aten.avg_pool3d_backward.default}
ADAPTIVE_AVG_2D = {aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default}
ADAPTIVE_AVG_3D = {aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default}
ADAPTIVE_MAX_2D = {aten.adaptive_max_pool2d.default, aten.adaptive_max_pool2d_backward.default}
ADAPTIVE_MAX_3D = {aten.adaptive_max_pool3d.default, aten.adaptive_max_pool3d_backward.default}


# name: (function, input shape, ops that must reach the backend)
CASES = {
    "max2d_padding": (lambda x: F.max_pool2d(x, 3, 2, 1, return_indices=True), (2, 3, 8, 9), MAX_2D),
    "max2d_ceil_dilation": (
        lambda x: F.max_pool2d(x, (3, 2), (2, 1), (1, 0), dilation=(1, 2), ceil_mode=True, return_indices=True),
        (2, 3, 8, 9),
        MAX_2D,
    ),
    "max2d_unbatched_overlapping": (lambda x: F.max_pool2d(x, 3, 1, return_indices=True), (3, 6, 5), MAX_2D),
    "max1d_ceil": (lambda x: F.max_pool1d(x, 3, 2, ceil_mode=True, return_indices=True), (2, 3, 10), MAX_2D),
    "max3d": (lambda x: F.max_pool3d(x, 2, (2, 1, 2), 1, return_indices=True), (2, 2, 4, 5, 4), MAX_3D),
    "avg2d_ceil_exclude_pad": (
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 8, 9), AVG_2D,
    ),
    "avg2d_ceil_include_pad": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), (2, 3, 8, 9), AVG_2D),
    "avg2d_divisor_override": (
        lambda x: F.avg_pool2d(x, (3, 2), (2, 3), (1, 1), divisor_override=5), (2, 3, 8, 9), AVG_2D,
    ),
    "avg2d_unbatched_overlapping": (lambda x: F.avg_pool2d(x, (2, 3), 1), (3, 5, 6), AVG_2D),
    "avg1d": (lambda x: F.avg_pool1d(x, 3, 2, 1, ceil_mode=True), (2, 3, 10), AVG_2D),
    "avg3d_exclude_pad": (lambda x: F.avg_pool3d(x, 2, 2, 1, count_include_pad=False), (2, 2, 4, 5, 3), AVG_3D),
    "adaptive_avg2d_irregular": (lambda x: F.adaptive_avg_pool2d(x, (3, 5)), (2, 3, 8, 9), ADAPTIVE_AVG_2D),
    "adaptive_avg2d_regular": (lambda x: F.adaptive_avg_pool2d(x, (4, 3)), (2, 3, 8, 9), ADAPTIVE_AVG_2D),
    "adaptive_avg2d_one_row": (lambda x: F.adaptive_avg_pool2d(x, (1, 3)), (2, 3, 5, 7), ADAPTIVE_AVG_2D),
    "adaptive_avg1d": (lambda x: F.adaptive_avg_pool1d(x, 3), (2, 3, 8), ADAPTIVE_AVG_2D),
    "adaptive_avg3d": (lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)), (1, 2, 5, 5, 6), ADAPTIVE_AVG_3D),
    "adaptive_max2d_irregular": (
        lambda x: F.adaptive_max_pool2d(x, (3, 5), return_indices=True), (2, 3, 8, 9), ADAPTIVE_MAX_2D,
    ),
    "adaptive_max2d_regular": (
        lambda x: F.adaptive_max_pool2d(x, (4, 3), return_indices=True), (2, 3, 8, 9), ADAPTIVE_MAX_2D,
    ),
    "adaptive_max1d": (lambda x: F.adaptive_max_pool1d(x, 3, return_indices=True), (2, 3, 8), ADAPTIVE_MAX_2D),
    "adaptive_max3d": (
        lambda x: F.adaptive_max_pool3d(x, (2, 3, 4), return_indices=True), (1, 2, 5, 5, 6), ADAPTIVE_MAX_3D,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_pooling_float32(aten_ops, case):
    fn, shape, ops = CASES[case]
    assert_compiles_like_eager(fn, torch.randn(shape), grad=True)
    assert ops <= aten_ops


def _max_pools(x):
    return (
        F.max_pool2d(x, 3, 2, 1, return_indices=True),
        F.max_pool2d(x, 2, 1, 1, dilation=2, ceil_mode=True, return_indices=True),
        F.adaptive_max_pool2d(x, (3, 5), return_indices=True),
        F.adaptive_max_pool2d(x, (4, 3), return_indices=True),
    )


def test_max_pool_ties_nan_and_infinity(aten_ops):
    """Ties go to the first element of a window, the last NaN wins, all -inf windows pick a real element."""
    x = torch.randint(0, 3, (2, 3, 8, 9)).float()
    x[0, 0, 1, 1] = x[0, 0, 1, 2] = x[1, 2, 5, 5] = float("nan")
    x[1, 1] = float("-inf")
    assert_compiles_like_eager(_max_pools, x, grad=True)
    assert aten_ops >= MAX_2D | ADAPTIVE_MAX_2D


def _mixed_pools(x):
    return (
        F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
        F.adaptive_avg_pool2d(x, (3, 5)),
        F.adaptive_avg_pool2d(x, 2),
        F.max_pool2d(x, 2),
    )


def test_pooling_bfloat16(aten_ops):
    assert_compiles_like_eager(_mixed_pools, torch.randn(2, 3, 8, 10).bfloat16(), grad=True)
    assert aten_ops >= AVG_2D | ADAPTIVE_AVG_2D | MAX_2D


def test_pooling_modules(aten_ops):
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.MaxPool2d(2, ceil_mode=True),
        torch.nn.ReLU(),
        torch.nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
        torch.nn.AdaptiveAvgPool2d((2, 3)),
        torch.nn.Flatten(),
    )
    assert_compiles_like_eager(model, torch.randn(2, 3, 9, 11), grad=True)
    assert aten_ops >= MAX_2D | AVG_2D | ADAPTIVE_AVG_2D
