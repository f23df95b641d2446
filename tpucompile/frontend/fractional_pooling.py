"""Fractional max pooling (``nn.FractionalMaxPool2d/3d``) as a gather and a max, with its backward as a
scatter-add: PyTorch has no decomposition for either.

Each output position pools a window of ``kernel_size`` whose start along a dimension follows PyTorch's
pseudo-random sequence, drawn from one sample ``u`` in [0, 1) per batch element, channel and dimension:
``start[i] = trunc((i + u) * alpha) - trunc(u * alpha)`` with ``alpha = (in - k) / (out - 1)``, computed in the
input's dtype as PyTorch's kernel does (the rounding decides which window a position gets), and the last
window ending at the input's edge. The samples are ordered width first in 2-D (``[w, h]``) and time first in
3-D (``[t, h, w]``), as in PyTorch's kernels. The indices returned are flat positions within each plane, ties
go to the first maximum in row-major order, as in the kernels.
"""

from __future__ import annotations

import torch


def _starts(sample: torch.Tensor, size: int, out: int, kernel: int) -> torch.Tensor:
    """The window starts ``(..., out)`` along one dimension for samples ``(...)``."""
    if out == 1:
        return torch.full((*sample.shape, 1), size - kernel, dtype=torch.int64, device=sample.device)
    alpha = torch.full((), size - kernel, dtype=sample.dtype, device=sample.device) / (out - 1)  # in its dtype
    positions = torch.arange(out - 1, device=sample.device).to(sample.dtype)
    starts = ((positions + sample[..., None]) * alpha).to(torch.int64) - (sample * alpha).to(torch.int64)[..., None]
    last = torch.full((*sample.shape, 1), size - kernel, dtype=torch.int64, device=sample.device)
    return torch.cat([starts, last], dim=-1)


def _pool(input: torch.Tensor, kernel_size, output_size, samples: torch.Tensor, sample_order: tuple[int, ...]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    dims = len(kernel_size)
    batched = input.dim() == dims + 2
    if not batched:
        input = input.unsqueeze(0)
        samples = samples.reshape(1, input.shape[1], -1)
    spatial = input.shape[2:]
    flat_index = None
    for d in range(dims):  # window positions along each dim, as flat offsets within a plane
        starts = _starts(samples[..., sample_order[d]], spatial[d], output_size[d], kernel_size[d])
        along = starts[..., None] + torch.arange(kernel_size[d], device=input.device)  # (N, C, out_d, k_d)
        stride = 1
        for later in spatial[d + 1:]:
            stride *= later
        shape = [*along.shape[:2]] + [1] * (2 * dims)
        shape[2 + d], shape[2 + dims + d] = along.shape[2], along.shape[3]
        term = (along * stride).reshape(shape)
        flat_index = term if flat_index is None else flat_index + term
    count = 1
    for k in kernel_size:
        count *= k
    outputs = flat_index.shape[2:2 + dims]
    flat_index = flat_index.reshape(*flat_index.shape[:2], -1, count)  # (N, C, outputs, window)
    planes = input.flatten(2)
    windows = torch.gather(planes, 2, flat_index.flatten(2)).reshape(flat_index.shape)
    values, position = windows.max(dim=-1)
    indices = torch.gather(flat_index, -1, position[..., None]).squeeze(-1)
    values, indices = values.reshape(*values.shape[:2], *outputs), indices.reshape(*indices.shape[:2], *outputs)
    if not batched:
        values, indices = values.squeeze(0), indices.squeeze(0)
    return values, indices


def fractional_max_pool2d(input, kernel_size, output_size, random_samples):
    return _pool(input, list(kernel_size), list(output_size), random_samples, (1, 0))


def fractional_max_pool3d(input, kernel_size, output_size, random_samples):
    return _pool(input, list(kernel_size), list(output_size), random_samples, (0, 1, 2))


def fractional_max_pool_backward(grad_output, input, kernel_size, output_size, indices):
    """Each output's gradient added to the input position it took its maximum from."""
    dims = len(kernel_size)
    batched = input.dim() == dims + 2
    grad = grad_output if batched else grad_output.unsqueeze(0)
    index = indices if batched else indices.unsqueeze(0)
    shape = input.shape if batched else (1, *input.shape)
    planes = torch.zeros(*shape[:2], input.shape[-dims:].numel(), dtype=grad.dtype, device=grad.device)
    planes = planes.scatter_add(2, index.flatten(2), grad.flatten(2)).reshape(shape)
    return planes if batched else planes.squeeze(0)


def fractional_pooling_decompositions() -> dict[torch._ops.OpOverload, object]:
    aten = torch.ops.aten
    return {aten.fractional_max_pool2d.default: fractional_max_pool2d,
            aten.fractional_max_pool3d.default: fractional_max_pool3d,
            aten.fractional_max_pool2d_backward.default: fractional_max_pool_backward,
            aten.fractional_max_pool3d_backward.default: fractional_max_pool_backward}
