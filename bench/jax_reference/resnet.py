"""examples/resnet.py's ResNet written by hand in plain JAX: the benchmark's reference for what XLA makes of
"the same model written in JAX" (the ``resnet`` and ``resnet18`` workloads).

``params`` holds the torch model's ``named_parameters()`` and ``named_buffers()`` under their torch names
(``stem.0.weight``, ``stages.1.bn2.running_var``, ``fc.bias``, ...) as jax arrays; the network's structure is
read from ``config`` (the example's ``ResNetConfig``), as the torch model builds it.

Deliberate differences from torch: BatchNorm computes its statistics and normalisation in float32 whatever the
parameters' dtype (torch's CPU kernels accumulate in float32 too), and the loss is a float32 scalar even for a
bfloat16 model (torch returns it in the logits' dtype). Convolutions and the classifier run in the
parameters' dtype.

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


class ResNetConfig(Protocol):
    """The fields of examples/resnet.py's ``ResNetConfig`` this module reads."""

    stem_kernel: int
    stem_stride: int
    stem_width: int
    widths: tuple[int, ...]
    blocks_per_stage: int


def forward(params: Params, inputs: tuple, config: ResNetConfig) -> jax.Array:
    """Logits ``(batch, num_classes)`` for ``inputs = (images,)``, in eval mode (BatchNorm uses the running
    statistics)."""
    (images,) = inputs
    logits, _ = _resnet(params, images, config, train=False)
    return logits


def loss(params: Params, inputs: tuple, config: ResNetConfig) -> tuple[jax.Array, Params]:
    """Mean cross-entropy of the logits against ``labels`` for ``inputs = (images, labels)``, in train mode
    (BatchNorm normalises with the batch statistics), and the BatchNorm buffers torch's forward would write."""
    images, labels = inputs
    logits, buffers = _resnet(params, images, config, train=True)
    return _cross_entropy(logits, labels), buffers


def _resnet(params: Params, x: jax.Array, config: ResNetConfig, train: bool) -> tuple[jax.Array, Params]:
    updates: Params = {}

    def bn(y: jax.Array, name: str) -> jax.Array:
        return _batch_norm(params, y, name, train, updates)

    # Stem: conv, BN, ReLU, 3x3/2 max pooling.
    x = _conv(x, params["stem.0.weight"], config.stem_stride, config.stem_kernel // 2)
    x = jax.nn.relu(bn(x, "stem.1"))
    x = _max_pool(x, window=3, stride=2, padding=1)

    # Basic blocks, numbered across stages as in the torch model's ``stages`` Sequential.
    channels = config.stem_width
    block_index = 0
    for stage, width in enumerate(config.widths):
        for block in range(config.blocks_per_stage):
            stride = 2 if stage > 0 and block == 0 else 1
            name = f"stages.{block_index}"
            y = jax.nn.relu(bn(_conv(x, params[f"{name}.conv1.weight"], stride, 1), f"{name}.bn1"))
            y = bn(_conv(y, params[f"{name}.conv2.weight"], 1, 1), f"{name}.bn2")
            if stride != 1 or channels != width:
                shortcut = bn(_conv(x, params[f"{name}.shortcut.0.weight"], stride, 0), f"{name}.shortcut.1")
            else:
                shortcut = x
            x = jax.nn.relu(y + shortcut)
            channels = width
            block_index += 1

    # Global average pooling, then the classifier.
    pooled = jnp.mean(x, axis=(2, 3))
    logits = pooled @ params["fc.weight"].T + params["fc.bias"]
    return logits, updates


def _conv(x: jax.Array, weight: jax.Array, stride: int, padding: int) -> jax.Array:
    """A bias-free 2-D convolution in torch's NCHW / OIHW layouts."""
    return lax.conv_general_dilated(
        x, weight, window_strides=(stride, stride), padding=((padding, padding), (padding, padding)),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )


def _max_pool(x: jax.Array, window: int, stride: int, padding: int) -> jax.Array:
    """Max pooling over H and W; the padding never wins (it is -inf)."""
    return lax.reduce_window(
        x, -jnp.inf, lax.max, window_dimensions=(1, 1, window, window), window_strides=(1, 1, stride, stride),
        padding=((0, 0), (0, 0), (padding, padding), (padding, padding)),
    )


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


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of ``labels`` under ``softmax(logits)``, in float32."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))
