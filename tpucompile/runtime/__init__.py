"""Running compiled programs: PJRT targets, compilation, DLPack exchange, per-shape specialisation."""

from tpucompile.runtime.compiler import compile_module, optimized_hlo, unoptimized_hlo
from tpucompile.runtime.executable import CONSTANT, INPUT, RESULT, SEED_POSITION, TRIMMED, GraphExecutable
from tpucompile.runtime.specialize import ShapeSpecializer
from tpucompile.runtime.target import (
    Target,
    build_flags,
    compile_options,
    compile_options_fingerprint,
    describe_compile_options,
    get_target,
)

__all__ = [
    "CONSTANT",
    "INPUT",
    "RESULT",
    "SEED_POSITION",
    "TRIMMED",
    "GraphExecutable",
    "ShapeSpecializer",
    "Target",
    "build_flags",
    "compile_module",
    "compile_options",
    "compile_options_fingerprint",
    "describe_compile_options",
    "get_target",
    "optimized_hlo",
    "unoptimized_hlo",
]
