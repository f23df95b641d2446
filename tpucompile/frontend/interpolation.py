"""Give 2-D nearest and (bi,tri)linear ``F.interpolate`` a backward of matrix products, before AOTAutograd.

PyTorch's Python dispatcher decomposes ``upsample_nearest2d`` and ``upsample_{linear1d,bilinear2d,
trilinear3d}`` at the autograd key, before any decomposition table applies, into gathers, and autograd turns
those into accumulating ``index_put``s in the backward (one for nearest, two per dim for linear): scatters,
which XLA's CPU backend runs one element at a time. These modes are linear and separable, ``out = A_h @ x @
A_w^T`` in 2-D with constant ``(out, in)`` matrices, so the gradient is ``A_h^T @ grad @ A_w``: one product
per resampled dim (docs/benchmarks.md has the measurements).

The forward stays a gather (it fuses into one loop, cheaper than two products): ``F.interpolate`` for
linear modes, and for nearest an index with the kernel's own source indices, because PyTorch's decomposition
of nearest resampling disagrees with its kernel when a scale factor keeps the size (``nearest_source``).
Only the backward is written as products, through an ``autograd.Function`` that AOTAutograd traces like any
other. One forward is not a gather: linear upsampling by a power of two without ``align_corners`` (``nn.Upsample
(scale_factor=2, mode="bilinear")`` in U-Nets and decoders) has the same two weights at every ``k``-th output, so
each of the ``k`` phases is a weighted sum of two shifted slices of the edge-padded input, interleaved
(``phase_upsample``): index arithmetic XLA fuses into one loop, faster than its gather on CPU.

The matrices hold the weights of PyTorch's CPU kernels, computed in float32 (float64 for float64 inputs) as
they do. Linear: source coordinate ``scale * (dst + 0.5) - 0.5`` clamped at 0 (``scale * dst`` with
``align_corners``), neighbours ``floor(src)`` and the next one clamped to the edge, weights ``1 - frac`` and
``frac``. Nearest: ``min(floor(dst * scale), size - 1)``, with the kernel's shortcuts for equal and doubled
sizes. Gradients of half-precision tensors are multiplied in float32 and rounded once.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.fx
import torch.nn.functional as F

from tpucompile.contracts.resize_scale import source_scale
from tpucompile.frontend.transforms import runs_functorch_transform

_MODES = {"nearest": 2, "linear": 1, "bilinear": 2, "trilinear": 3}
"""The modes handled, with the number of resampled dims each requires. Nearest is taken in 2-D only: in 1-D
and 3-D, PyTorch's CPU forward and backward kernels disagree on which element a size-keeping factor copies
(1.1 on 6 elements: the forward reads 0, 0, 1, 2, 3, 4, the backward credits 0, 1, 2, 3, 4, 5), so no
gradient matches both; those stay with PyTorch's decomposition."""


def rewrite_interpolation(gm: torch.fx.GraphModule) -> int:
    """Point every nearest or linear ``F.interpolate`` call at ``interpolate_by_products``; returns how many.
    A graph that runs a ``torch.func`` transform is left as it is (``transforms``)."""
    if runs_functorch_transform(gm):
        return 0
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.interpolate and _mode(node) in _MODES:
            node.target = interpolate_by_products
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def interpolate_by_products(
    input: torch.Tensor,
    size: int | tuple[int, ...] | None = None,
    scale_factor: float | tuple[float, ...] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> torch.Tensor:
    """``F.interpolate`` with the same arguments; for nearest or linear resampling of a float tensor of static
    size the gradient is one product per resampled dim. Anything else goes to ``F.interpolate`` alone (which
    also reports bad arguments)."""
    plan = _plan(input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
    if plan is None:
        return F.interpolate(input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias)
    return _ResampleWithProductGradient.apply(input, size, scale_factor, mode, align_corners,
                                              recompute_scale_factor, *plan)


class _ResampleWithProductGradient(torch.autograd.Function):
    """Forward: a gather (``F.interpolate`` itself, or for nearest the kernel's indices). Backward: each
    resampled dim of the gradient multiplied by its resampling matrix, transposed."""

    @staticmethod
    def forward(ctx, input, size, scale_factor, mode, align_corners, recompute_scale_factor, out_sizes, scales):
        ctx.in_sizes, ctx.out_sizes, ctx.scales = tuple(input.shape[2:]), out_sizes, scales
        ctx.mode, ctx.corners, ctx.dtype = mode, bool(align_corners), input.dtype
        if mode == "nearest":
            sources = [nearest_source(size_in, size_out, scale, input.device)
                       for size_in, size_out, scale in zip(ctx.in_sizes, out_sizes, scales, strict=True)]
            count = len(sources)
            # Broadcastable index tensors, one per resampled dim: dim i varies along axis i of the result.
            grid = [source.reshape([-1] + [1] * (count - 1 - i)) for i, source in enumerate(sources)]
            return input[(slice(None), slice(None), *grid)]
        if not align_corners:
            factors = _power_of_two_factors(ctx.in_sizes, out_sizes, scales)
            if factors is not None:
                return phase_upsample(input, factors)
        return F.interpolate(input, size, scale_factor, mode, align_corners, recompute_scale_factor)

    @staticmethod
    def backward(ctx, grad):
        work = torch.float32 if ctx.dtype in (torch.float16, torch.bfloat16) else ctx.dtype
        result = grad.to(work)
        count = len(ctx.in_sizes)
        for i in reversed(range(count)):
            matrix = resampling_matrix(ctx.mode, ctx.in_sizes[i], ctx.out_sizes[i], ctx.corners, ctx.scales[i], work,
                                       grad.device)
            dim = i - count
            # The last two dims contract in place (x @ M, M^T @ x); a third moves last and back.
            if dim == -1:
                result = torch.matmul(result, matrix)
            elif dim == -2:
                result = torch.matmul(matrix.t(), result)
            else:
                result = torch.matmul(result.movedim(dim, -1), matrix).movedim(-1, dim)
        return result.to(ctx.dtype), None, None, None, None, None, None, None


def phase_upsample(input: torch.Tensor, factors: list[int]) -> torch.Tensor:
    """Linear upsampling without ``align_corners`` of the resampled dims of ``input`` (all after the first
    two) by the integer ``factors`` (1 leaves a dim alone), exactly as PyTorch's CPU kernel weighs it when each
    factor is a power of two and the source scale its inverse. Output ``k * m + r`` of a dim upsampled by ``k``
    sits at source ``m + f``, ``f = (r + 0.5) / k - 0.5``: it is ``-f * x[m - 1] + (1 + f) * x[m]`` for
    ``f < 0`` and ``(1 - f) * x[m] + f * x[m + 1]`` otherwise, with the neighbours clamped to the edge (as the
    kernel clamps its source index). The weights are exact binary fractions; half-precision inputs are
    computed in float32 and rounded once, as the kernel does. The last dim is resampled first, the order in
    which the kernel combines its taps."""
    work = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    result = input.to(work)
    for dim in reversed(range(2, input.dim())):
        k = factors[dim - 2]
        if k == 1:
            continue
        n = result.shape[dim]
        padded = torch.cat([result.narrow(dim, 0, 1), result, result.narrow(dim, n - 1, 1)], dim)
        phases = []
        for r in range(k):
            f = (r + 0.5) / k - 0.5
            if f < 0:
                phases.append(padded.narrow(dim, 0, n) * -f + padded.narrow(dim, 1, n) * (1 + f))
            else:
                phases.append(padded.narrow(dim, 1, n) * (1 - f) + padded.narrow(dim, 2, n) * f)
        result = torch.stack(phases, dim + 1).flatten(dim, dim + 1)
    return result.to(input.dtype)


def _power_of_two_factors(in_sizes: tuple[int, ...], out_sizes: list[int], scales: list[float | None]
                          ) -> list[int] | None:
    """Per resampled dim, the factor ``phase_upsample`` upsamples it by, or None unless every dim keeps its
    size or grows by a power of two with the kernel's source scale exactly its inverse (a factor of 2.0001
    that still doubles the size does not qualify: its weights drift along the dim)."""
    factors = []
    for size_in, size_out, scale in zip(in_sizes, out_sizes, scales, strict=True):
        k, remainder = divmod(size_out, size_in)
        if remainder or k & (k - 1) or source_scale(size_in, size_out, False, scale) != 1.0 / k:
            return None
        factors.append(k)
    return factors if any(k > 1 for k in factors) else None


def resampling_matrix(
    mode: str,
    size_in: int,
    size_out: int,
    align_corners: bool,
    scale_factor: float | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The ``(size_out, size_in)`` weights of ``mode`` resampling along one dim, as PyTorch's CPU kernels
    compute them (``scale_factor``: the user's factor, which sets the source scale unless ``align_corners``)."""
    positions = torch.arange(size_in, device=device)
    if mode == "nearest":
        return (positions == nearest_source(size_in, size_out, scale_factor, device)[:, None]).to(dtype)
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    destination = torch.arange(size_out, dtype=accumulate, device=device)
    scale = source_scale(size_in, size_out, align_corners, scale_factor)
    source = destination * scale if align_corners else ((destination + 0.5) * scale - 0.5).clamp(min=0)
    first = source.to(torch.int64).clamp(max=size_in - 1)
    second = (first + 1).clamp(max=size_in - 1)
    weight = (source - first.to(accumulate)).clamp(0, 1)[:, None]
    matrix = (positions == first[:, None]).to(accumulate) * (1 - weight)
    matrix = matrix + (positions == second[:, None]).to(accumulate) * weight
    return matrix.to(dtype)


def nearest_source(size_in: int, size_out: int, scale_factor: float | None, device: torch.device | str = "cpu"
                   ) -> torch.Tensor:
    """The input index each output index copies in nearest resampling along one dim, as PyTorch's CPU kernel
    picks it: itself for equal sizes, half of it for doubled ones, else ``min(floor(dst * scale), size - 1)``
    in float32. (PyTorch's own decomposition lacks the equal-size case: with a factor such as 1.1 that keeps
    the size, it reads other elements than the kernel does.)"""
    destination = torch.arange(size_out, device=device)
    if size_out == size_in:
        return destination
    if size_out == 2 * size_in:
        return destination // 2
    scale = source_scale(size_in, size_out, False, scale_factor)
    return (destination.to(torch.float32) * scale).floor().to(torch.int64).clamp(max=size_in - 1)


def _mode(node: torch.fx.Node) -> object:
    return node.kwargs["mode"] if "mode" in node.kwargs else node.args[3] if len(node.args) > 3 else "nearest"


def _plan(
    input: torch.Tensor,
    size: object,
    scale_factor: object,
    mode: str,
    align_corners: bool | None,
    recompute_scale_factor: bool | None,
    antialias: bool,
) -> tuple[list[int], list[float | None]] | None:
    """(output sizes, scale factors the kernel would use) for a call this pass computes, else None (nearest
    with ``align_corners`` included: ``F.interpolate`` refuses it with its own message)."""
    if mode not in _MODES or antialias or not input.is_floating_point():
        return None
    if mode == "nearest" and align_corners is not None:
        return None
    count = input.dim() - 2
    if _MODES[mode] != count:
        return None
    in_sizes = list(input.shape[2:])
    if not all(isinstance(s, int) and s > 0 for s in in_sizes) or (size is None) == (scale_factor is None):
        return None
    if size is not None:
        out_sizes = [size] * count if isinstance(size, int) else list(size)
        if len(out_sizes) != count or not all(isinstance(s, int) and s > 0 for s in out_sizes):
            return None
        return out_sizes, [None] * count
    factors = [scale_factor] * count if isinstance(scale_factor, numbers.Real) else list(scale_factor)
    if len(factors) != count or not all(isinstance(f, numbers.Real) and f > 0 for f in factors):
        return None
    out_sizes = [math.floor(float(s) * float(f)) for s, f in zip(in_sizes, factors, strict=True)]
    if min(out_sizes) <= 0:
        return None
    return out_sizes, [None] * count if recompute_scale_factor else [float(f) for f in factors]
