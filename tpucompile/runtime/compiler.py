"""StableHLO → loaded XLA executable through the PJRT client."""

from __future__ import annotations

from collections.abc import Iterable

from jaxlib import xla_client

from tpucompile.errors import CompileError
from tpucompile.runtime import depthwise
from tpucompile.runtime.custom_calls import make_ready
from tpucompile.runtime.host_kernels import kernel_choice
from tpucompile.runtime.targets.local import Target
from tpucompile.runtime.xla_options import compile_options


def compile_module(module: bytes | str, target: Target, num_partitions: int | None = None,
                   host_ops: Iterable[str] | None = None, depthwise_taps: bool = True) -> object:
    """Compile StableHLO (MLIR bytecode or text) for ``target`` and load it on its devices (one partition per
    device unless ``num_partitions`` says otherwise). ``host_ops``: the signatures of the ops that call the host
    kernels (``kernel_choice.chosen_ops``); None sends every op they take. ``depthwise_taps``: as ``for_target``."""
    module = for_target(module, target, host_ops, depthwise_taps)
    try:
        loaded = target.client.compile_and_load(module, target.device_list(), compile_options(target, num_partitions))
    except Exception as error:  # XlaRuntimeError and friends: keep XLA's words, say whose they are
        raise CompileError(f"XLA failed to compile the lowered program for {target.platform}: {error}") from error
    try:
        make_ready(loaded, target.platform)
    except RuntimeError as error:
        raise CompileError(f"{error} ({target.platform})") from error
    return loaded


def for_target(module: bytes | str, target: Target, host_ops: Iterable[str] | None = None,
               depthwise_taps: bool = True) -> bytes | str:
    """``module`` as ``target`` compiles it: on one CPU device with host kernels, the matrix products and f32
    convolutions named by ``host_ops`` (all they take when None) call them (``kernel_choice``); on the CPU with
    ``depthwise_taps``, depthwise convolutions are sums over their taps (``depthwise``); otherwise unchanged."""
    module = kernel_choice.apply(module, target, host_ops)
    return depthwise.rewrite(module) if depthwise_taps and target.platform == "cpu" else module


def unoptimized_hlo(module: bytes | str) -> str:
    """XLA HLO of a StableHLO module as XLA's passes first see it (for dumps; compiling does not need it)."""
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
        module, use_tuple_args=False, return_tuple=False
    )
    return computation.get_hlo_module().to_string()


def optimized_hlo(executable: object) -> str:
    """The HLO modules of a compiled executable, after XLA's optimisation passes (for dumps)."""
    return "\n".join(module.to_string() for module in executable.hlo_modules())
