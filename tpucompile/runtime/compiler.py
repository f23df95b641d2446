"""StableHLO → loaded XLA executable through the PJRT client."""

from __future__ import annotations

from tpucompile.errors import CompileError
from tpucompile.runtime.target import Target, compile_options


def compile_module(module: bytes | str, target: Target, num_partitions: int = 1) -> object:
    """Compile StableHLO (MLIR bytecode or text) for ``target`` and load it on its devices."""
    try:
        return target.client.compile_and_load(module, target.device_list(), compile_options(target, num_partitions))
    except Exception as error:  # XlaRuntimeError and friends: keep XLA's words, say whose they are
        raise CompileError(f"XLA failed to compile the lowered program for {target.platform}: {error}") from error
