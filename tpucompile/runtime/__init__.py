"""Running compiled programs: PJRT targets, compilation, DLPack exchange, per-shape specialisation."""

from tpucompile.runtime.compiler import compile_module
from tpucompile.runtime.executable import CONSTANT, INPUT, RESULT, SEED_POSITION, GraphExecutable
from tpucompile.runtime.specialize import ShapeSpecializer
from tpucompile.runtime.target import Target, compile_options, get_target

__all__ = [
    "CONSTANT",
    "INPUT",
    "RESULT",
    "SEED_POSITION",
    "GraphExecutable",
    "ShapeSpecializer",
    "Target",
    "compile_module",
    "compile_options",
    "get_target",
]
