"""The ordering constraint of ``contracts.schedule_ops``: one optimization barrier over the values, whose
results stand for them from then on."""

from __future__ import annotations

from typing import Any

from jax.extend.mlir.dialects import stablehlo

from tpucompile.contracts.schedule_ops import together
from tpucompile.lowering.registry import LoweringContext, register_rule


@register_rule(together)
def _together(ctx: LoweringContext, *values: Any) -> tuple[Any, ...]:
    del ctx
    return tuple(stablehlo.OptimizationBarrierOp(list(values)).results)
