"""Runtime assertions on sizes that Dynamo puts in graphs (``u0 >= 0`` after a ``nonzero``, …).

Every program is compiled for one concrete set of sizes, so a size assertion is decided while lowering: it
holds for every call this program will ever see, or it fails now, with PyTorch's own message, before the
program could run on sizes it was not meant for.
"""

from __future__ import annotations

import torch

from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten


@register_rule(aten._assert_scalar.default)
def _assert_scalar(ctx, condition, message):
    if not condition:
        raise RuntimeError(message)


@register_rule(aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default)
def _constrain_range(ctx, size, min=None, max=None):
    if (min is not None and size < min) or (max is not None and size > max):
        raise RuntimeError(f"size {size} is outside its declared range [{min}, {max}]")


@register_rule(aten._assert_tensor_metadata.default)
def _assert_tensor_metadata(ctx, x, size=None, stride=None, dtype=None, *, device=None, layout=None):
    """``torch.export`` checks a tensor's dtype and sizes before a ``.to()``: decided against the traced
    operand, which is what the program will always see. Strides and devices are not the program's (its
    values have neither), so they are not checked."""
    meta = ctx.operand_metas[0]
    if dtype is not None and meta.dtype != dtype:
        raise RuntimeError(f"tensor has dtype {meta.dtype}, expected {dtype}")
    if size is not None and tuple(meta.shape) != tuple(size):
        raise RuntimeError(f"tensor has sizes {tuple(meta.shape)}, expected {tuple(size)}")
