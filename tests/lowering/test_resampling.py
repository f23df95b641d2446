"""Interpolation and edge padding against eager PyTorch, end to end through ``torch.compile`` with gradients.

Nearest / (tri)linear / bicubic interpolation and reflect padding reach the backend already decomposed
into ``index`` (forward) and ``index_put`` or ``index`` (backward); these tests check that, and that the
result matches. 2-D nearest and (bi,tri)linear interpolation get a backward of matrix products before
AOTAutograd (``passes/interpolation.py``), so their gradients do not scatter. Replicate padding's backward
and anti-aliased interpolation reach the backend as ATen ops of their own, lowered in ``rules/resampling.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support import assert_compiles_like_eager

aten = torch.ops.aten


def _interpolations_2d(x):
    return (
        F.interpolate(x, scale_factor=2, mode="nearest"),
        F.interpolate(x, size=(7, 9), mode="nearest"),
        F.interpolate(x, scale_factor=(1.5, 0.6), mode="nearest-exact"),
        F.interpolate(x, scale_factor=2, mode="bilinear"),
        F.interpolate(x, scale_factor=(1.7, 0.6), mode="bilinear", recompute_scale_factor=False),
        F.interpolate(x, size=(7, 9), mode="bilinear", align_corners=True),
        F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=True),
    )


def test_interpolate_2d(aten_ops):
    assert_compiles_like_eager(_interpolations_2d, torch.randn(2, 3, 4, 5), grad=True)
    assert {aten.index.Tensor, aten.index_put.default} <= aten_ops


PRODUCT_GRADIENT_CALLS = {
    "bilinear_up2": dict(mode="bilinear", scale_factor=2),
    "bilinear_up2_align_corners": dict(mode="bilinear", scale_factor=2, align_corners=True),
    "bilinear_mixed_factors": dict(mode="bilinear", scale_factor=(1.7, 0.6)),
    "bilinear_mixed_recomputed": dict(mode="bilinear", scale_factor=(1.7, 0.6), recompute_scale_factor=True),
    "bilinear_size_down_odd": dict(mode="bilinear", size=(3, 4)),
    "bilinear_size_align_corners": dict(mode="bilinear", size=(9, 1), align_corners=True),
    "bilinear_size_int": dict(mode="bilinear", size=6),
    "nearest_up2": dict(mode="nearest", scale_factor=2),
    "nearest_same_size_odd_factor": dict(mode="nearest", scale_factor=(1.1, 2.5)),
    "nearest_mixed_factors_recomputed": dict(mode="nearest", scale_factor=(1.7, 0.6), recompute_scale_factor=True),
    "nearest_size": dict(mode="nearest", size=(11, 3)),
}

PRODUCT_GRADIENT_CALLS_1D_3D = {
    "linear_up": ((2, 3, 6), dict(mode="linear", scale_factor=2.5)),
    "linear_align_corners": ((2, 3, 6), dict(mode="linear", size=4, align_corners=True)),
    "trilinear": ((1, 2, 3, 4, 5), dict(mode="trilinear", scale_factor=(2, 0.5, 1.5))),
    "trilinear_align_corners": ((1, 2, 3, 4, 5), dict(mode="trilinear", size=(5, 2, 7), align_corners=True)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("call", PRODUCT_GRADIENT_CALLS)
def test_resampling_gradient_is_products(aten_ops, call, dtype):
    """Every form of the sizes and scales, up and down, with gradients; the forward gathers, the backward
    multiplies and never scatters."""
    kwargs = PRODUCT_GRADIENT_CALLS[call]
    x = torch.randn(2, 3, 5, 7, dtype=dtype)
    assert_compiles_like_eager(lambda x: F.interpolate(x, **kwargs), x, grad=True)
    assert aten.index_put.default not in aten_ops
    assert aten_ops & {aten.mm.default, aten.bmm.default}


@pytest.mark.parametrize("call", PRODUCT_GRADIENT_CALLS_1D_3D)
def test_resampling_gradient_is_products_1d_3d(aten_ops, call):
    shape, kwargs = PRODUCT_GRADIENT_CALLS_1D_3D[call]
    assert_compiles_like_eager(lambda x: F.interpolate(x, **kwargs), torch.randn(shape), grad=True)
    assert aten.index_put.default not in aten_ops
    assert aten_ops & {aten.mm.default, aten.bmm.default}


SLICED_UPSAMPLING_CALLS = {
    "bilinear_up2": ((2, 3, 5, 7), dict(mode="bilinear", scale_factor=2)),
    "bilinear_up4_rows_only": ((2, 3, 5, 7), dict(mode="bilinear", scale_factor=(4, 1))),
    "bilinear_size_doubles_columns": ((2, 3, 5, 7), dict(mode="bilinear", size=(5, 14))),
    "bilinear_single_pixel": ((2, 3, 1, 1), dict(mode="bilinear", scale_factor=2)),
    "bilinear_up2_recomputed": ((2, 3, 5, 7), dict(mode="bilinear", scale_factor=2.0, recompute_scale_factor=True)),
    "linear_up8": ((2, 3, 6), dict(mode="linear", scale_factor=8)),
    "trilinear_mixed": ((1, 2, 3, 4, 5), dict(mode="trilinear", scale_factor=(2, 1, 4))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("call", SLICED_UPSAMPLING_CALLS)
def test_power_of_two_linear_upsampling_is_sliced(aten_ops, call, dtype):
    """Linear upsampling by powers of two (no ``align_corners``) is computed from shifted slices, not gathered,
    with the kernel's weights; the backward stays products."""
    shape, kwargs = SLICED_UPSAMPLING_CALLS[call]
    x = torch.randn(shape, dtype=dtype)
    assert_compiles_like_eager(lambda x: F.interpolate(x, **kwargs), x, grad=True)
    assert not aten_ops & {aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default}
    assert aten_ops & {aten.mm.default, aten.bmm.default}


def test_sliced_upsampling_of_a_channels_last_activation(aten_ops):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Upsample(scale_factor=2, mode="bilinear"))
    x = torch.randn(2, 3, 6, 4).to(memory_format=torch.channels_last)
    assert_compiles_like_eager(model, x, grad=True)
    assert aten.index.Tensor not in aten_ops


@pytest.mark.parametrize(
    "kwargs",
    [dict(mode="bilinear", scale_factor=3), dict(mode="bilinear", scale_factor=2, align_corners=True),
     dict(mode="bilinear", scale_factor=2.0001), dict(mode="bilinear", scale_factor=(2, 0.5))],
    ids=["factor_3", "align_corners", "factor_off_by_a_little", "one_dim_down"],
)
def test_other_linear_resampling_still_gathers(aten_ops, kwargs):
    """Factors whose weights are not the same at every k-th output keep the gather, and still match."""
    assert_compiles_like_eager(lambda x: F.interpolate(x, **kwargs), torch.randn(2, 3, 5, 7), grad=True)
    assert aten.index.Tensor in aten_ops or aten._unsafe_index.Tensor in aten_ops


def test_resampling_modules_and_channels_last(aten_ops):
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.Upsample(scale_factor=2, mode="bilinear"),
        torch.nn.UpsamplingBilinear2d(size=(11, 5)),
        torch.nn.Upsample(scale_factor=(2, 3)),
        torch.nn.UpsamplingNearest2d(size=(30, 20)),
    )
    x = torch.randn(2, 3, 6, 4).to(memory_format=torch.channels_last)
    assert_compiles_like_eager(model, x, grad=True)
    assert aten.index_put.default not in aten_ops


def _interpolations_1d_3d(x1, x3):
    return (
        F.interpolate(x1, scale_factor=2, mode="linear"),
        F.interpolate(x1, size=7, mode="linear", align_corners=True),
        F.interpolate(x1, scale_factor=2.5, mode="nearest"),
        F.interpolate(x3, scale_factor=2, mode="trilinear"),
        F.interpolate(x3, size=(2, 5, 3), mode="nearest"),
    )


def test_interpolate_1d_3d(aten_ops):
    assert_compiles_like_eager(_interpolations_1d_3d, torch.randn(2, 3, 4), torch.randn(1, 2, 3, 4, 3), grad=True)
    assert {aten.index.Tensor, aten.index_put.default} <= aten_ops


def test_upsample_modules(aten_ops):
    model = torch.nn.Sequential(
        torch.nn.Upsample(scale_factor=2, mode="nearest"),
        torch.nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
        torch.nn.UpsamplingBilinear2d(scale_factor=1.5),
    )
    assert_compiles_like_eager(model, torch.randn(1, 2, 4, 3), grad=True)
    assert aten.index.Tensor in aten_ops


REPLICATION_BACKWARD = {
    1: aten.replication_pad1d_backward.default,
    2: aten.replication_pad2d_backward.default,
    3: aten.replication_pad3d_backward.default,
}


@pytest.mark.parametrize(
    "shape, pad",
    [
        ((2, 3, 5), (-1, 3)),
        ((2, 3, 5), (2, -2)),
        ((3, 1), (3, 2)),
        ((2, 3, 4, 5), (1, 2, 2, 1)),
        ((1, 2, 4, 6), (-2, -1, 3, -1)),
        ((1, 2, 3, 4, 3), (1, 2, 0, 1, 2, 1)),
    ],
    ids=["1d_crop_low", "1d_crop_high", "1d_unbatched_single", "2d", "2d_crops", "3d"],
)
def test_replicate_pad(aten_ops, shape, pad):
    assert_compiles_like_eager(lambda x: F.pad(x, pad, mode="replicate"), torch.randn(shape), grad=True)
    assert REPLICATION_BACKWARD[len(pad) // 2] in aten_ops


def test_reflect_pad(aten_ops):
    def pads(x1, x2, x3):
        return (
            F.pad(x1, (1, 3), mode="reflect"),
            F.pad(x2, (1, 2, 2, 1), mode="reflect"),
            F.pad(x3, (1, 2, 1, 1, 2, 1), mode="reflect"),
        )

    assert_compiles_like_eager(
        pads, torch.randn(2, 3, 4), torch.randn(2, 3, 4, 5), torch.randn(1, 2, 4, 3, 4), grad=True
    )
    assert aten.index.Tensor in aten_ops


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(scale_factor=0.5, mode="bilinear"),
        dict(size=(3, 13), mode="bilinear"),
        dict(size=(3, 13), mode="bilinear", align_corners=True),
        dict(scale_factor=(0.4, 1.7), mode="bicubic"),
        dict(size=(5, 4), mode="bicubic", align_corners=True),
    ],
    ids=["bilinear_down", "bilinear_mixed", "bilinear_align_corners", "bicubic_scales", "bicubic_align_corners"],
)
def test_interpolate_antialias(aten_ops, kwargs):
    assert_compiles_like_eager(lambda x: F.interpolate(x, antialias=True, **kwargs), torch.randn(2, 3, 8, 9), grad=True)
    mode = kwargs["mode"]
    assert getattr(aten, f"_upsample_{mode}2d_aa").default in aten_ops
    assert getattr(aten, f"_upsample_{mode}2d_aa_backward").default in aten_ops
