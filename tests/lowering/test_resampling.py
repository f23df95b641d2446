"""Interpolation and edge padding against eager PyTorch, end to end through ``torch.compile`` with gradients.

Nearest / (bi,tri)linear / bicubic interpolation and reflect padding reach the backend already decomposed
into ``index`` (forward) and ``index_put`` or ``index`` (backward); these tests check that, and that the
result matches. Replicate padding's backward and anti-aliased interpolation reach the backend as ATen ops of
their own, lowered in ``rules/resampling.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import assert_compiles_like_eager

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
