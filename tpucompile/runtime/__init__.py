"""Running compiled programs: PJRT targets, compilation, DLPack exchange, per-shape specialisation."""

import jax  # noqa: F401  (first: jax quiets jaxlib's C++ INFO logs before jaxlib loads)

from tpucompile.runtime.compiler import compile_module, optimized_hlo, unoptimized_hlo
from tpucompile.runtime.distributed import initialize as initialize_distributed
from tpucompile.runtime.distributed import process_count, process_devices
from tpucompile.runtime.executable import CONSTANT, INPUT, RESULT, SEED_POSITION, TRIMMED, GraphExecutable
from tpucompile.runtime.sharded import ShardedExecutable
from tpucompile.runtime.specialize import ShapeSpecializer
from tpucompile.runtime.target import (
    Target,
    build_flags,
    compile_options,
    compile_options_fingerprint,
    describe_compile_options,
    get_mesh_target,
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
    "ShardedExecutable",
    "Target",
    "build_flags",
    "compile_module",
    "compile_options",
    "compile_options_fingerprint",
    "describe_compile_options",
    "get_mesh_target",
    "get_target",
    "initialize_distributed",
    "optimized_hlo",
    "process_count",
    "process_devices",
    "unoptimized_hlo",
]
