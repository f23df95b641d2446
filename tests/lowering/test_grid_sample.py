"""``grid_sampler_2d`` / ``grid_sampler_3d`` and their backwards (``rules/grid_sample.py``) against eager."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager, compile_fn

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(int(os.environ.get("TPUCOMPILE_TEST_SEED", "0")))


def _grid(*shape):
    return torch.rand(*shape) * 2.6 - 1.3  # reaches outside [-1, 1], so the padding modes matter


@pytest.mark.parametrize(
    ("mode", "padding", "align_corners"),
    [("bilinear", "zeros", False), ("bilinear", "reflection", True), ("nearest", "border", False),
     ("bicubic", "reflection", False)],
)
def test_grid_sample_2d(aten_ops, mode, padding, align_corners):
    image, grid = torch.randn(2, 3, 5, 6), _grid(2, 4, 7, 2)
    assert_compiles_like_eager(
        lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align_corners),
        image, grid, grad=True, atol=1e-4, rtol=1e-4,
    )
    assert {aten.grid_sampler_2d.default, aten.grid_sampler_2d_backward.default} <= aten_ops


@pytest.mark.parametrize(("mode", "padding"), [("bilinear", "zeros"), ("nearest", "reflection")])
def test_grid_sample_3d(aten_ops, mode, padding):
    image, grid = torch.randn(2, 2, 4, 5, 3), _grid(2, 3, 2, 4, 3)
    assert_compiles_like_eager(
        lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=False),
        image, grid, grad=True, atol=1e-4, rtol=1e-4,
    )
    assert {aten.grid_sampler_3d.default, aten.grid_sampler_3d_backward.default} <= aten_ops


def test_grid_sample_bf16():
    """bf16 is sampled in f32 and rounded once: compare with eager's f32 result (eager's bf16 kernel rounds
    its weights too and is the less accurate of the two)."""
    image, grid = torch.randn(1, 2, 6, 6).bfloat16(), _grid(1, 3, 3, 2).bfloat16()

    def fn(x, g):
        return F.grid_sample(x, g, align_corners=True)

    actual = compile_fn(fn)(image, grid)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual, fn(image.float(), grid.float()).bfloat16(), atol=1e-2, rtol=1.6e-2)


def test_grid_sample_grid_only_grad():
    image = torch.randn(1, 2, 6, 6)
    assert_compiles_like_eager(lambda g: F.grid_sample(image, g, mode="bilinear", align_corners=False),
                               _grid(1, 3, 3, 2), grad=True, atol=1e-4, rtol=1e-4)
