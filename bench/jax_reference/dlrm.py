"""examples/dlrm.py's DLRM written by hand in plain JAX: the benchmark's reference for what XLA makes of "the
same model written in JAX" (the ``dlrm`` workload).

``params`` holds the torch model's ``named_parameters()`` and ``named_buffers()`` under their torch names
(``bottom.0.weight``, ``tables.2.weight``, ``top.4.bias``, ...) as jax arrays; the layer sizes are read from
``config`` (the example's ``DLRMConfig``), as the torch model builds them. Inputs are the workload's:
``dense (batch, dense_features)``, then per table a flat index array and the start offset of each bag, as
``nn.EmbeddingBag`` takes them (bags of any length, empty ones included).

Deliberate differences from torch: the pairs of the feature interaction are picked with static indices (numpy's
``triu_indices``, the same pairs in the same order) rather than read from the model's ``pair_rows`` /
``pair_cols`` buffers, which are therefore unused here; each bag is summed with ``jax.ops.segment_sum`` (the
torch model's ``mode="sum"``); the loss is computed in float32 and returned as a float32 scalar even for a
bfloat16 model. The model has no buffers it updates, so ``loss``'s second result is empty.

``config`` is an unhashable dataclass: close over it (``functools.partial(loss, config=config)``) rather than
passing it as a static argument to ``jax.jit``. ``params`` includes the integer ``pair_rows`` / ``pair_cols``
buffers, so differentiating with respect to the whole dict needs ``allow_int=True`` (their gradients are
``float0`` zeros), or differentiate with respect to the floating-point entries only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, jax.Array]


class DLRMConfig(Protocol):
    """The fields of examples/dlrm.py's ``DLRMConfig`` this module reads."""

    table_sizes: tuple[int, ...]
    bottom_mlp: tuple[int, ...]
    top_mlp: tuple[int, ...]


def forward(params: Params, inputs: tuple, config: DLRMConfig) -> jax.Array:
    """One logit per example, ``(batch,)``, for ``inputs = (dense, indices, offsets)`` where ``indices[t]`` and
    ``offsets[t]`` are table t's bags."""
    dense, indices, offsets = inputs
    return _dlrm(params, dense, indices, offsets, config)


def loss(params: Params, inputs: tuple, config: DLRMConfig) -> tuple[jax.Array, Params]:
    """Mean binary cross-entropy of the logits against the 0/1 ``labels`` for
    ``inputs = (dense, indices, offsets, labels)``, and no buffer updates (an empty dict)."""
    dense, indices, offsets, labels = inputs
    logits = _dlrm(params, dense, indices, offsets, config).astype(jnp.float32)
    labels = labels.astype(jnp.float32)
    losses = -(labels * jax.nn.log_sigmoid(logits) + (1 - labels) * jax.nn.log_sigmoid(-logits))
    return jnp.mean(losses), {}


def _dlrm(params: Params, dense: jax.Array, indices: Sequence[jax.Array], offsets: Sequence[jax.Array],
          config: DLRMConfig) -> jax.Array:
    # Bottom MLP, ReLU after every layer (Linear layers at Sequential entries 0, 2, 4, ...).
    x = _mlp(params, "bottom", dense, layers=len(config.bottom_mlp) + 1, last_activation=True)
    bags = [
        _embedding_bag_sum(params[f"tables.{t}.weight"], ids, starts)
        for t, (ids, starts) in enumerate(zip(indices, offsets, strict=True))
    ]
    # Interaction: every pairwise dot product of the dense vector and the bag embeddings, each unordered pair
    # once (the strict upper triangle, row by row).
    features = jnp.stack([x, *bags], axis=1)  # (batch, 1 + tables, dim)
    dots = jnp.einsum("bfd,bgd->bfg", features, features)
    rows, cols = np.triu_indices(1 + len(config.table_sizes), k=1)
    pairs = dots[:, rows, cols]
    top_in = jnp.concatenate([x, pairs], axis=1)
    return _mlp(params, "top", top_in, layers=len(config.top_mlp) + 1, last_activation=False)[:, 0]


def _mlp(params: Params, name: str, x: jax.Array, layers: int, last_activation: bool) -> jax.Array:
    """examples/dlrm.py's ``mlp``: Linear layers with a ReLU after each but (unless ``last_activation``) the
    last; the ReLUs take Sequential entries too, so the Linear layers are entries 0, 2, 4, ..."""
    for layer in range(layers):
        x = x @ params[f"{name}.{2 * layer}.weight"].T + params[f"{name}.{2 * layer}.bias"]
        if last_activation or layer < layers - 1:
            x = jax.nn.relu(x)
    return x


def _embedding_bag_sum(table: jax.Array, ids: jax.Array, starts: jax.Array) -> jax.Array:
    """``nn.EmbeddingBag(mode="sum")``: bag ``b`` is ``ids[starts[b]:starts[b + 1]]`` (the last runs to the end),
    and its embedding is the sum of those rows of ``table``, zeros for an empty bag."""
    # The bag of the id at position p is the last bag starting at or before p.
    bag_of_id = jnp.searchsorted(starts, jnp.arange(ids.shape[0]), side="right") - 1
    return jax.ops.segment_sum(table[ids], bag_of_id, num_segments=starts.shape[0])
