"""examples/unet.py's UNet written by hand in plain JAX: the benchmark's reference for what XLA makes of "the
same model written in JAX" (the ``unet`` workload).

``params`` holds the torch model's ``named_parameters()`` and ``named_buffers()`` under their torch names
(``inc.0.weight``, ``down.1.4.running_mean``, ``up.0.up.bias``, ``head.weight``, ...) as jax arrays; the
network's structure is read from ``config`` (the example's ``UNetConfig``), as the torch model builds it.

Deliberate differences from torch: BatchNorm computes its statistics and normalisation in float32 whatever the
parameters' dtype (torch's CPU kernels accumulate in float32 too), and the loss is a float32 scalar even for a
bfloat16 model (torch returns it in the logits' dtype). The decoder's 2x upsampling is written for the model's
fixed scale factor of 2 (bilinear: fixed 1/4, 3/4 blends of neighbours, which is what ``F.interpolate`` with
``align_corners=False`` computes at that scale).

``config`` is an unhashable dataclass: close over it (``functools.partial(loss, config=config)``) rather than
passing it as a static argument to ``jax.jit``. ``params`` includes the integer ``num_batches_tracked``
buffers, so differentiating with respect to the whole dict needs ``allow_int=True`` (their gradients are
``float0`` zeros), or differentiate with respect to the floating-point entries only.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax

BN_EPS = 1e-5
BN_MOMENTUM = 0.1

Params = dict[str, jax.Array]


class UNetConfig(Protocol):
    """The fields of examples/unet.py's ``UNetConfig`` this module reads."""

    up_modes: tuple[str, ...]


def forward(params: Params, inputs: tuple, config: UNetConfig) -> jax.Array:
    """Per-pixel logits ``(batch, num_classes, height, width)`` for ``inputs = (images,)``, in eval mode
    (BatchNorm uses the running statistics)."""
    (images,) = inputs
    logits, _ = _unet(params, images, config, train=False)
    return logits


def loss(params: Params, inputs: tuple, config: UNetConfig) -> tuple[jax.Array, Params]:
    """Mean per-pixel cross-entropy of the logits against ``masks`` for ``inputs = (images, masks)``, in train
    mode (BatchNorm normalises with the batch statistics), and the BatchNorm buffers torch's forward would
    write."""
    images, masks = inputs
    logits, buffers = _unet(params, images, config, train=True)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=1)
    return -jnp.mean(jnp.take_along_axis(log_probs, masks[:, None], axis=1)), buffers


def _unet(params: Params, x: jax.Array, config: UNetConfig, train: bool) -> tuple[jax.Array, Params]:
    updates: Params = {}

    def conv_block(y: jax.Array, name: str) -> jax.Array:
        """``ConvBlock``: (3x3 conv, BatchNorm, ReLU) twice, as Sequential entries 0-2 and 3-5."""
        for conv, bn in ((0, 1), (3, 4)):
            y = _conv(y, params[f"{name}.{conv}.weight"], padding=1)
            y = jax.nn.relu(_batch_norm(params, y, f"{name}.{bn}", train, updates))
        return y

    x = conv_block(x, "inc")
    skips = []
    for level in range(len(config.up_modes)):
        skips.append(x)
        x = conv_block(_max_pool_2x2(x), f"down.{level}")
    for level, (mode, skip) in enumerate(zip(config.up_modes, reversed(skips), strict=True)):
        name = f"up.{level}"
        weight, bias = params[f"{name}.up.weight"], params[f"{name}.up.bias"]
        if mode == "transpose":
            x = _conv_transpose_2x2(x, weight, bias)
        else:
            x = _conv(_upsample_2x(x, mode), weight, padding=0, bias=bias)
        x = conv_block(jnp.concatenate([skip, x], axis=1), f"{name}.block")
    logits = _conv(x, params["head.weight"], padding=0, bias=params["head.bias"])
    return logits, updates


def _conv(x: jax.Array, weight: jax.Array, padding: int, bias: jax.Array | None = None) -> jax.Array:
    """A stride-1 2-D convolution in torch's NCHW / OIHW layouts."""
    y = lax.conv_general_dilated(
        x, weight, window_strides=(1, 1), padding=((padding, padding), (padding, padding)),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )
    return y if bias is None else y + bias[:, None, None]


def _conv_transpose_2x2(x: jax.Array, weight: jax.Array, bias: jax.Array) -> jax.Array:
    """``nn.ConvTranspose2d(kernel_size=2, stride=2)``; torch's weight is ``(in, out, kH, kW)``, the kernel of
    the convolution this one transposes (OIHW with O = this layer's input channels)."""
    y = lax.conv_transpose(
        x, weight, strides=(2, 2), padding="VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"),
        transpose_kernel=True,
    )
    return y + bias[:, None, None]


def _upsample_2x(x: jax.Array, mode: str) -> jax.Array:
    """``F.interpolate(x, scale_factor=2, mode=mode)`` over H and W, ``align_corners=False`` for bilinear."""
    if mode == "nearest":
        return jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)
    if mode != "bilinear":
        raise ValueError(f"unsupported upsampling mode {mode!r}")
    return _linear_upsample_2x(_linear_upsample_2x(x, axis=2), axis=3)


def _linear_upsample_2x(x: jax.Array, axis: int) -> jax.Array:
    """Linear 2x upsampling along ``axis`` with half-pixel centres: output ``2i`` samples input ``i - 1/4`` and
    ``2i + 1`` samples ``i + 1/4``, clamped at the edges (edge padding gives exactly the clamped blend)."""
    n = x.shape[axis]
    padded = jnp.pad(x, [(1, 1) if a == axis else (0, 0) for a in range(x.ndim)], mode="edge")
    before = lax.slice_in_dim(padded, 0, n, axis=axis)
    after = lax.slice_in_dim(padded, 2, n + 2, axis=axis)
    even = 0.25 * before + 0.75 * x
    odd = 0.75 * x + 0.25 * after
    # Interleave: stack right after ``axis`` and merge the two.
    stacked = jnp.stack([even, odd], axis=axis + 1)
    return stacked.reshape(*x.shape[:axis], 2 * n, *x.shape[axis + 1:])


def _max_pool_2x2(x: jax.Array) -> jax.Array:
    """``F.max_pool2d(x, 2)`` over NCHW."""
    return lax.reduce_window(x, -jnp.inf, lax.max, window_dimensions=(1, 1, 2, 2), window_strides=(1, 1, 2, 2),
                             padding="VALID")


def _batch_norm(params: Params, x: jax.Array, name: str, train: bool, updates: Params) -> jax.Array:
    """``nn.BatchNorm2d`` over NCHW. In train mode, normalises with the batch's mean and biased variance and
    records the running statistics torch would write (momentum 0.1, unbiased variance) in ``updates``."""
    running_mean = params[f"{name}.running_mean"]
    running_var = params[f"{name}.running_var"]
    x32 = x.astype(jnp.float32)
    if train:
        mean = jnp.mean(x32, axis=(0, 2, 3))
        var = jnp.mean(jnp.square(x32 - mean[:, None, None]), axis=(0, 2, 3))
        count = x.shape[0] * x.shape[2] * x.shape[3]
        unbiased = var * (count / (count - 1))
        updates[f"{name}.running_mean"] = (
            (1 - BN_MOMENTUM) * running_mean.astype(jnp.float32) + BN_MOMENTUM * mean
        ).astype(running_mean.dtype)
        updates[f"{name}.running_var"] = (
            (1 - BN_MOMENTUM) * running_var.astype(jnp.float32) + BN_MOMENTUM * unbiased
        ).astype(running_var.dtype)
        tracked = params[f"{name}.num_batches_tracked"]
        updates[f"{name}.num_batches_tracked"] = tracked + jnp.ones((), tracked.dtype)
    else:
        mean = running_mean.astype(jnp.float32)
        var = running_var.astype(jnp.float32)
    scale = params[f"{name}.weight"].astype(jnp.float32) * lax.rsqrt(var + BN_EPS)
    shift = params[f"{name}.bias"].astype(jnp.float32) - mean * scale
    return (x32 * scale[:, None, None] + shift[:, None, None]).astype(x.dtype)
