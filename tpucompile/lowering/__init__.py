"""ATen FX graph → StableHLO, built with the MLIR Python bindings shipped in jaxlib."""

from tpucompile.lowering import rules  # noqa: F401  (registers every lowering rule)
from tpucompile.lowering.graph import LoweredProgram, OutputSlot, lower_graph
from tpucompile.lowering.registry import register_rule
from tpucompile.lowering.shapes import ShapeBindings, is_symbolic
from tpucompile.lowering.types import TensorSpec

__all__ = [
    "LoweredProgram",
    "OutputSlot",
    "ShapeBindings",
    "TensorSpec",
    "is_symbolic",
    "lower_graph",
    "register_rule",
]
