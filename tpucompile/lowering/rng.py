"""Random bits for RNG ops, from a seed the runtime draws from torch's generator on every call.

A program with random ops gets one extra ``tensor<2xi64>`` argument, the seed. Each random op takes its own
Threefry key, ``seed + (0, k)`` for the op's ordinal ``k``, so ops draw independent streams and a call is
reproducible under ``torch.manual_seed``. The numbers follow the same distributions as eager PyTorch, not the
same values: compiled randomness matches eager statistically, never bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo

SEED_SHAPE = (2,)


def _unsigned(bits: int, shape: Sequence[int]) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(shape), ir.IntegerType.get_unsigned(bits))


class RandomStream:
    """Hands each random op of one program a distinct generator state derived from the seed argument."""

    def __init__(self, seed: ir.Value) -> None:
        self._seed = hlo.bitcast_convert(_unsigned(64, SEED_SHAPE), seed)
        self._count = 0

    def bits(self, shape: Sequence[int], width: int = 32) -> ir.Value:
        """A tensor of uniformly random unsigned integers (``ui32`` or ``ui64``) of ``shape``."""
        self._count += 1
        offset = hlo.constant(
            ir.DenseElementsAttr.get(np.array([0, self._count], dtype=np.uint64), type=_unsigned(64, ()).element_type)
        )
        state = hlo.add(self._seed, offset)
        result = hlo.rng_bit_generator(
            _unsigned(64, SEED_SHAPE), _unsigned(width, shape), hlo.RngAlgorithmAttr.get("THREE_FRY"), state
        )
        return result[1]
