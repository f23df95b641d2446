"""Running compiled programs: PJRT targets, compilation, DLPack exchange, per-shape specialisation.

``targets/`` says what programs are compiled for (this process's devices, other hosts of a mesh, TPU slices
that are not here); ``xla_options`` and ``compiler`` turn StableHLO into an executable for one, handing CPU
products and convolutions to ``host_kernels/`` where those win; ``executable`` and ``sharded`` run it on torch
tensors (``calling_convention`` maps its arguments and results to the graph's; ``transfer`` and ``resident``
move tensors in and out); ``specialize`` keeps one executable per concrete shape; ``custom_calls`` readies
the libraries a cached program calls.
"""

import jax  # noqa: F401  (first: jax quiets jaxlib's C++ INFO logs before jaxlib loads)

from tpucompile.contracts.calling_convention import SEED_POSITION, OutputSlot
from tpucompile.runtime.compiler import compile_module, optimized_hlo, unoptimized_hlo
from tpucompile.runtime.executable import GraphExecutable
from tpucompile.runtime.shape_only import ShapeOnlyExecutable
from tpucompile.runtime.sharded import ShardedExecutable
from tpucompile.runtime.specialize import ShapeSpecializer
from tpucompile.runtime.targets.distributed import initialize as initialize_distributed
from tpucompile.runtime.targets.distributed import process_count, process_devices
from tpucompile.runtime.targets.local import Target, get_mesh_target, get_target
from tpucompile.runtime.xla_options import (
    build_flags,
    compile_options,
    compile_options_fingerprint,
    describe_compile_options,
)

__all__ = [
    "SEED_POSITION",
    "GraphExecutable",
    "OutputSlot",
    "ShapeOnlyExecutable",
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
