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



# ----------------------------------------------------------------------------------------------------------
# Grids whose output size differs from the image's size: the image's gradient has the image's shape, not the
# grid's, in every mode, padding mode and align_corners.

_MODES_2D = ("bilinear", "nearest", "bicubic")
_PADDINGS = ("zeros", "border", "reflection")


def _tolerance(mode: str) -> dict:
    """float32's defaults, except for bicubic: each output sums 16 taps with weights up to ~1.2 in magnitude
    (the grid's gradient sums their derivatives, larger still), and eager adds them in another order, so
    rounding reaches several times the default atol of 1e-5."""
    return dict(atol=1e-4, rtol=1e-4) if mode == "bicubic" else {}


@pytest.mark.parametrize(("align_corners", "out_size"), [(False, (2, 2)), (True, (7, 5))],
                         ids=["corners_false-grid_smaller", "corners_true-grid_larger"])
@pytest.mark.parametrize("mode", _MODES_2D)
def test_grid_sample_2d_every_mode(aten_ops, mode, align_corners, out_size):
    """A 2x3x4x4 image read at 2x2 points (fewer than its pixels) or 7x5 (more), each mode with every padding
    mode (one graph holds the three) and both align_corners: forward, and the image's and the grid's
    gradients."""
    image, grid = torch.randn(2, 3, 4, 4), _grid(2, *out_size, 2)

    def every_padding(x, g):
        return [F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align_corners)
                for padding in _PADDINGS]

    assert_compiles_like_eager(every_padding, image, grid, grad=True, **_tolerance(mode))
    assert {aten.grid_sampler_2d.default, aten.grid_sampler_2d_backward.default} <= aten_ops


def test_grid_sample_2d_one_image_two_grids():
    """A 1x1x4x4 image sampled by a 2x2 grid and by a 7x5 grid in one graph."""

    def fn(x, g_small, g_large):
        return (F.grid_sample(x, g_small, align_corners=True), F.grid_sample(x, g_large, align_corners=True))

    assert_compiles_like_eager(fn, torch.randn(1, 1, 4, 4), _grid(1, 2, 2, 2), _grid(1, 7, 5, 2), grad=True)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_2d_pyramid(aten_ops, mode):
    """RAFT's correlation pyramid: one detached grid samples images of several sizes. The backward asks for
    the images' gradients alone (and ``nearest`` has no grid gradient to compute), so the images' values never
    reach the lowered function; the 4x4 and 2x2 levels, sampled by the same 3x3 grid, must not share one
    lowering."""
    grid = _grid(2, 3, 3, 2)

    def fn(a, b):
        g = grid.detach()
        return tuple(F.grid_sample(x, g, mode=mode, padding_mode="border", align_corners=True) for x in (a, b))

    assert_compiles_like_eager(fn, torch.randn(2, 3, 4, 4), torch.randn(2, 3, 2, 2), grad=True)
    assert aten.grid_sampler_2d_backward.default in aten_ops


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_2d_image_only_grad(mode):
    """``output_mask`` (True, False): the grid is a constant, only the image gets a gradient."""
    grid = _grid(2, 5, 3, 2)
    assert_compiles_like_eager(
        lambda x: F.grid_sample(x, grid, mode=mode, padding_mode="reflection", align_corners=False),
        torch.randn(2, 3, 4, 6), grad=True,
    )


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_2d_grid_only_grad(mode):
    """``output_mask`` (False, True): the image is a constant, only the grid gets a gradient (zero for
    ``nearest``, whose backward then computes nothing)."""
    image = torch.randn(2, 3, 4, 6)
    assert_compiles_like_eager(lambda g: F.grid_sample(image, g, mode=mode, align_corners=True),
                               _grid(2, 5, 3, 2), grad=True)


@pytest.mark.parametrize(
    ("mode", "padding", "align_corners"),
    [("bilinear", "zeros", True), ("bilinear", "border", False), ("bilinear", "border", True),
     ("bilinear", "reflection", False), ("bilinear", "reflection", True),
     ("nearest", "zeros", True), ("nearest", "border", False), ("nearest", "reflection", True)],
)
def test_grid_sample_3d_grid_size_differs(aten_ops, mode, padding, align_corners):
    """The 3-d sampler (no bicubic, as in PyTorch), with a grid smaller than the image along depth and height
    and larger along width; (bilinear, zeros, False) and (nearest, reflection, False) are in
    ``test_grid_sample_3d``."""
    image, grid = torch.randn(2, 2, 3, 4, 2), _grid(2, 1, 2, 5, 3)
    assert_compiles_like_eager(
        lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align_corners),
        image, grid, grad=True,
    )
    assert {aten.grid_sampler_3d.default, aten.grid_sampler_3d_backward.default} <= aten_ops


def test_grid_sample_3d_pyramid():
    """The pyramid of ``test_grid_sample_2d_pyramid`` in 3-d: one detached grid over two volumes."""
    grid = _grid(1, 2, 2, 3, 3)

    def fn(a, b):
        g = grid.detach()
        return tuple(F.grid_sample(x, g, padding_mode="reflection", align_corners=False) for x in (a, b))

    assert_compiles_like_eager(fn, torch.randn(1, 2, 3, 4, 2), torch.randn(1, 2, 2, 2, 3), grad=True)
