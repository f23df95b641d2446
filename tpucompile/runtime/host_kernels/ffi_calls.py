"""StableHLO custom calls of the typed XLA FFI handlers the host kernels' library registers (``library``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo as hlo


def row_major(rank: int) -> Any:
    """The layout attribute of a row-major operand or result of ``rank`` dimensions."""
    return ir.DenseIntElementsAttr.get(np.arange(rank - 1, -1, -1, dtype=np.int64), type=ir.IndexType.get())


def ffi_call(target: str, result_types: Sequence[Any], operands: Sequence[Any], attributes: dict[str, int]) -> Any:
    """A call of the FFI handler ``target`` with row-major operands and results and integer ``attributes``;
    the operation (its results are ``.results``). Insert it under an ``ir.InsertionPoint``."""
    op = hlo.CustomCallOp.build_generic(
        results=list(result_types),
        operands=list(operands),
        attributes={
            "call_target_name": ir.StringAttr.get(target),
            "has_side_effect": ir.BoolAttr.get(False),
            "backend_config": ir.StringAttr.get(""),
            # The typed FFI's attributes travel in ``mhlo.backend_config`` (a dictionary); StableHLO's verifier
            # wants a string ``backend_config`` for API version 4, so the call says version 1 and XLA's
            # import reads the dictionary as the typed FFI does (as jax's own FFI calls do).
            "api_version": ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1),
            "called_computations": ir.ArrayAttr.get([]),
            "operand_layouts": ir.ArrayAttr.get([row_major(ir.RankedTensorType(v.type).rank) for v in operands]),
            "result_layouts": ir.ArrayAttr.get([row_major(ir.RankedTensorType(t).rank) for t in result_types]),
        },
    )
    i64 = ir.IntegerType.get_signless(64)
    op.operation.attributes["mhlo.backend_config"] = ir.DictAttr.get(
        {name: ir.IntegerAttr.get(i64, int(value)) for name, value in attributes.items()}
    )
    return op
