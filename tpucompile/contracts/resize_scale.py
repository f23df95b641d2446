"""PyTorch's resize geometry, shared by the graph rewrite of interpolation and the resampling lowering.

Pure arithmetic on Python numbers, so the frontend can use it without loading MLIR or the lowering rules.
"""

from __future__ import annotations


def source_scale(size: int, out: int, align_corners: bool, scale_factor: float | None) -> float:
    """Input pixels per output pixel, as PyTorch's ``area_pixel_compute_scale`` defines it (``scale_factor``:
    the user's factor, which sets it unless ``align_corners``)."""
    if align_corners:
        return (size - 1) / (out - 1) if out > 1 else 0.0
    if scale_factor is not None and scale_factor > 0:
        return 1.0 / scale_factor
    return size / out
