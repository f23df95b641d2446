"""Eager PyTorch is the reference the tests compare against; this keeps that reference exact.

Torch's CPU wheels route contiguous float unary ops (``tanh``, ``exp``, ``sqrt``, ...) to the vector math of
the oneMKL they bundle (2024.2), which picks each function's kernel on that function's first call. When that
first call runs on several of torch's intra-op threads at once, one thread can run a low-accuracy kernel over
its whole chunk (pytorch/pytorch#188792): in a fresh process, eager ``torch.tanh`` of a 128x512 tensor then
has the rows of one thread's chunk off by up to ~1e-5, and a product after it by ~1e-4. Later calls are exact.
Calling each such function once on a tensor too small to be split settles the choice on one thread.
"""

from __future__ import annotations

import torch

# The functions ATen hands to oneMKL's vector math (aten/src/ATen/cpu/vml.h), float32 and float64 each.
VECTOR_MATH_OPS = (
    torch.acos, torch.asin, torch.atan, torch.cos, torch.erf, torch.erfc, torch.erfinv, torch.exp, torch.log,
    torch.log10, torch.log2, torch.sin, torch.sqrt, torch.tan, torch.tanh, torch.trunc,
)


def settle_vector_math_dispatch() -> None:
    """Make every vector-math function's first call a single-threaded one (a tensor of 8 elements is far
    below the size at which ATen splits an op across threads)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((8,), 0.5, dtype=dtype)
        for op in VECTOR_MATH_OPS:
            op(x)
