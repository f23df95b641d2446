"""Cutting and padding tensors on the host without waking torch's intra-op threads.

A bucketed call pads its inputs to the bucket and cuts its results back to their actual sizes. Done with
torch ops, a copy of more than torch's grain size runs as an OpenMP parallel region, after which torch's pool
threads spin waiting for more work (OpenMP's default wait policy) while XLA's own threads run the next
program on the same cores: on a 2-core machine each such copy made the next execution about 2 ms slower,
doubling a small model's bucketed step. Copies of more than that size run on the calling thread through
numpy instead, which has no pool; they are a few hundred microseconds at most at the sizes a bucket pads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

_SAME_SIZE_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

SERIAL_ELEMENTS = 32768
"""torch's grain size (``at::internal::GRAIN_SIZE``): smaller copies run on the calling thread in torch too, and
torch's ops cost less per call than numpy's there."""


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s memory as a numpy array (a view): dtypes numpy lacks (bfloat16, float8) as the integer
    type of their size, which copies the same bytes."""
    tensor = tensor.detach().resolve_conj().resolve_neg()
    try:
        return tensor.numpy()
    except TypeError:
        return tensor.view(_SAME_SIZE_INTEGERS[tensor.element_size()]).numpy()


def cut(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A new contiguous tensor holding ``tensor``'s leading ``shape`` (each dimension cut at its end)."""
    if tensor.device.type != "cpu" or math.prod(shape) < SERIAL_ELEMENTS:  # or meta tensors of a compile-only run
        return tensor[tuple(slice(0, n) for n in shape)].clone()
    out = torch.empty(tuple(shape), dtype=tensor.dtype)
    np.copyto(_as_numpy(out), _as_numpy(tensor)[tuple(slice(0, n) for n in shape)])
    return out


def pad(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``tensor`` with zeros appended at the end of each dimension up to ``shape``; where ``tensor`` is
    longer than ``shape`` (padded to another bucket), cut to it."""
    shape = tuple(shape)
    if tuple(tensor.shape) == shape:
        return tensor
    if tensor.device.type != "cpu" or math.prod(shape) < SERIAL_ELEMENTS:
        widths = [(0, want - have) for have, want in zip(reversed(tensor.shape), reversed(shape), strict=True)]
        return torch.nn.functional.pad(tensor, [w for pair in widths for w in pair])
    source = _as_numpy(tensor)
    out = torch.from_numpy(np.zeros(shape, dtype=source.dtype))
    if out.dtype != tensor.dtype:
        out = out.view(tensor.dtype)
    common = tuple(slice(0, min(have, want)) for have, want in zip(tensor.shape, shape, strict=True))
    np.copyto(_as_numpy(out)[common], source[common])
    return out


def write_leading(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source`` into the leading ``source.shape`` of ``target`` (contiguous, at least as large in every
    dimension, same dtype)."""
    region = tuple(slice(0, n) for n in source.shape)
    if source.device.type != "cpu" or source.numel() < SERIAL_ELEMENTS:
        target[region].copy_(source)
        return
    np.copyto(_as_numpy(target)[region], _as_numpy(source))


def zero(target: torch.Tensor) -> None:
    """Fill the contiguous ``target`` with zeros."""
    if target.device.type != "cpu" or target.numel() < SERIAL_ELEMENTS:
        target.zero_()
        return
    _as_numpy(target).fill(0)
