"""``grid_sampler_2d`` / ``grid_sampler_3d`` and their backwards, through ``jax_bridge``.

The sampler is written once, for any number of spatial dims, as a jax function that follows ATen's
``GridSampler`` step by step: grid coordinates are unnormalised to pixel space (``align_corners`` decides
whether -1 and 1 are the centres or the outer edges of the corner pixels), then moved inside the image for
the ``border`` (clip) and ``reflection`` (reflect, then clip) padding modes; ``zeros`` padding reads 0 outside
it. ``bilinear`` blends the 2^k surrounding pixels, ``nearest`` rounds half to even, ``bicubic`` (2-d only)
applies the cubic convolution kernel (A = -0.75) to the 4x4 surrounding taps, each tap's position padded on
its own. The backward is ``jax.vjp`` of that same function, so forward and backward always agree; they match
ATen's hand-written derivatives everywhere except on the measure-zero set where a coordinate sits exactly on
a clipping or reflection boundary.

bfloat16/float16 operands are computed in float32, as PyTorch's CPU kernels accumulate.
"""

from __future__ import annotations

import torch

from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import builder, jax_bridge
from tpucompile.lowering.registry import register_rule

aten = torch.ops.aten

BILINEAR, NEAREST, BICUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2
_CUBIC_A = -0.75


def _unnormalize(coord, size: int, align_corners: bool):
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _clip(coord, size: int):
    import jax.numpy as jnp

    return jnp.minimum(size - 1, jnp.maximum(coord, 0))


def _reflect(coord, twice_low: int, twice_high: int):
    import jax.numpy as jnp

    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    coord = jnp.abs(coord - low)
    extra = jnp.fmod(coord, span)
    flips = jnp.floor(coord / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _pad_coordinate(coord, size: int, padding: int, align_corners: bool):
    """``compute_coordinates``: move an unnormalised coordinate inside the image for border/reflection."""
    if padding == BORDER:
        return _clip(coord, size)
    if padding == REFLECTION:
        if align_corners:
            coord = _reflect(coord, 0, 2 * (size - 1))
        else:
            coord = _reflect(coord, -1, 2 * size - 1)
        return _clip(coord, size)
    return coord


def _fetch(image, positions):
    """``image[n, :, *positions]`` (N, C, *out) for int positions (one per spatial dim, each (N, *out)), and
    0 where any position falls outside the image (the ``zeros`` padding)."""
    import jax.numpy as jnp

    sizes = image.shape[2:]
    inside = None
    clamped = []
    for position, size in zip(positions, sizes, strict=True):
        ok = (position >= 0) & (position < size)
        inside = ok if inside is None else inside & ok
        clamped.append(jnp.clip(position, 0, size - 1))
    batch = jnp.arange(image.shape[0]).reshape((-1,) + (1,) * (positions[0].ndim - 1))
    values = image[(batch, slice(None), *clamped)]  # advanced indices split by a slice: (N, *out, C)
    values = jnp.moveaxis(values, -1, 1)
    return jnp.where(inside[:, None], values, jnp.zeros((), values.dtype))


def _cubic_weights(t):
    """The four cubic-convolution weights of taps -1, 0, 1, 2 for a fractional offset ``t``."""
    a = _CUBIC_A

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def grid_sample(image, grid, mode: int, padding: int, align_corners: bool):
    """ATen's grid sampler on jax arrays: ``image`` (N, C, *spatial), ``grid`` (N, *out, k) holding
    (x, y[, z]) in [-1, 1], result (N, C, *out)."""
    import jax.numpy as jnp

    sizes = image.shape[2:]
    k = len(sizes)
    # grid[..., 0] addresses the last spatial dim (x → W), grid[..., k - 1] the first.
    coords = [_unnormalize(grid[..., k - 1 - d], sizes[d], align_corners) for d in range(k)]
    if mode == BICUBIC:
        lows = [jnp.floor(c) for c in coords]
        weights = [_cubic_weights(c - low) for c, low in zip(coords, lows, strict=True)]

        def tap(d, i):
            position = _pad_coordinate(lows[d] - 1 + i, sizes[d], padding, align_corners)
            return position.astype(jnp.int64)

        rows = []
        for i in range(4):  # along dim 0 (y), blending along dim 1 (x) first, as ATen does
            row = None
            for j in range(4):
                term = _fetch(image, [tap(0, i), tap(1, j)]) * weights[1][j][:, None]
                row = term if row is None else row + term
            rows.append(row)
        out = None
        for i in range(4):
            term = rows[i] * weights[0][i][:, None]
            out = term if out is None else out + term
        return out
    coords = [_pad_coordinate(c, size, padding, align_corners) for c, size in zip(coords, sizes, strict=True)]
    if mode == NEAREST:
        return _fetch(image, [jnp.round(c).astype(jnp.int64) for c in coords])
    lows = [jnp.floor(c) for c in coords]
    fractions = [c - low for c, low in zip(coords, lows, strict=True)]
    out = None
    for corner in range(2**k):
        offsets = [(corner >> (k - 1 - d)) & 1 for d in range(k)]
        weight = None
        for d, offset in enumerate(offsets):
            w = fractions[d] if offset else 1 - fractions[d]
            weight = w if weight is None else weight * w
        positions = [(low + offset).astype(jnp.int64) for low, offset in zip(lows, offsets, strict=True)]
        term = _fetch(image, positions) * weight[:, None]
        out = term if out is None else out + term
    return out


def _check(mode: int, spatial: int) -> None:
    if mode not in (BILINEAR, NEAREST, BICUBIC):
        raise UnsupportedOpError(f"grid_sampler with interpolation_mode={mode} is not supported")
    if mode == BICUBIC and spatial != 2:
        raise UnsupportedOpError("grid_sampler: bicubic interpolation needs 4-d input (as in PyTorch)")


def _forward(ctx, image, grid, mode, padding, align_corners):
    _check(mode, builder.rank_of(image) - 2)
    out_dtype = ctx.aval_out.dtype
    work = builder.accumulator_dtype(out_dtype)
    image, grid = builder.convert(image, work), builder.convert(grid, work)

    def fn(x, g):
        return grid_sample(x, g, mode, padding, bool(align_corners))

    spec = type(ctx.aval_out)(ctx.aval_out.shape, work)
    (out,) = jax_bridge.call("grid_sampler", fn, [image, grid], [spec], params=(mode, padding, bool(align_corners)))
    return builder.convert(out, out_dtype)


@register_rule(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def _grid_sampler(ctx, image, grid, interpolation_mode, padding_mode, align_corners):
    return _forward(ctx, image, grid, interpolation_mode, padding_mode, align_corners)


@register_rule(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def _grid_sampler_backward(ctx, grad, image, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    """``jax.vjp`` of the forward. The gradient of the grid is zero for ``nearest``; the image's values are
    passed to jax only when the grid's gradient needs them (the image's own gradient does not depend on
    them). The image's shape is then known to jax only through the closure, so it is part of the memo key:
    without it, two samplers of the same grid over images of different sizes (an image pyramid) would share
    one lowering and get each other's gradient shape."""
    _check(interpolation_mode, builder.rank_of(image) - 2)
    specs = ctx.avals_out
    mode, padding, corners = interpolation_mode, padding_mode, bool(align_corners)
    wanted = [bool(m) and s is not None for m, s in zip(output_mask, specs, strict=True)]
    computed = [wanted[0], wanted[1] and mode != NEAREST]
    work = builder.accumulator_dtype(builder.dtype_of(grad))
    image_shape = builder.shape_of(image)
    grad, image, grid = (builder.convert(v, work) for v in (grad, image, grid))
    operands = [grad, grid] + ([image] if computed[1] else [])

    def fn(g, grd, *maybe_image):
        import jax
        import jax.numpy as jnp

        x = maybe_image[0] if maybe_image else jnp.zeros(image_shape, g.dtype)
        _, pullback = jax.vjp(lambda a, b: grid_sample(a, b, mode, padding, corners), x, grd)
        grads = pullback(g)
        return tuple(grads[i] for i in range(2) if computed[i])

    result_specs = [type(s)(s.shape, work) for s, c in zip(specs, computed, strict=True) if c]
    grads = iter(jax_bridge.call("grid_sampler_backward", fn, operands, result_specs,
                                 params=(mode, padding, corners, tuple(computed), tuple(image_shape)))
                 if result_specs else [])
    results = []
    for spec, done in zip(specs, computed, strict=True):
        if spec is None:
            results.append(None)
        elif done:
            results.append(builder.convert(next(grads), spec.dtype))
        else:
            results.append(builder.constant(0, spec.dtype, spec.shape))
    return results
