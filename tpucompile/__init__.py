"""tpucompile: a torch.compile backend that lowers PyTorch graphs to StableHLO and runs them with XLA.

    torch.compile(model, backend="tpucompile")

The backend name is registered through the ``torch_dynamo_backends`` entry point, so no import is needed.
"""

__version__ = "0.1.0"

import os
from collections.abc import Sequence
from typing import Any

from tpucompile.config import Options
from tpucompile.errors import (
    CacheMissError,
    CompileError,
    LoweringError,
    OptionsError,
    ShardingError,
    TpuCompileError,
    TpuCompileWarning,
    UnsupportedOpError,
)
from tpucompile.metrics import compile_stats, memory_accounting
from tpucompile.sharding.plan import Mesh, ShardPlan, data_parallel, fully_sharded, tensor_parallel

_LOWERING_API = ("register_lowering", "remove_lowering")


def __getattr__(name: str) -> object:
    """``register_lowering`` and ``remove_lowering`` (``tpucompile.lowering.custom_ops``), loaded on first use:
    importing tpucompile stays light (the backend is found through its entry point, without MLIR)."""
    if name in _LOWERING_API:
        import importlib

        return getattr(importlib.import_module("tpucompile.lowering.custom_ops"), name)
    raise AttributeError(f"module 'tpucompile' has no attribute {name!r}")


def stats() -> dict:
    """What this process compiled and reused, in total and per graph (by the name its logs use):
    ``compiles`` (executables compiled), ``hits`` (executables found, by cache tier: memory, local, remote),
    ``recompiles`` (one reason per compile of a graph after its first: the new sizes or bucket),
    ``bucket_hits`` (calls served by the executable of a bucket compiled before) and ``stack_copies`` (calls
    that stacked a rolled run's parameters by copy: a graph's first call, and any after their ``.data`` was
    replaced; every call, where they cannot be views of one buffer)."""
    return compile_stats.snapshot()


def export(model: Any, example_args: Sequence[Any], path: str | os.PathLike, dynamic_shapes: Any = None,
           buckets: Any = None, platforms: Sequence[str] = ("cpu",)) -> dict:
    """Write ``model`` as a directory a process with jax alone can serve: StableHLO programs in jax.export's
    serialisation, safetensors weights and ``manifest.json`` (``tpucompile.exporting.writer.export``); returns
    the manifest. Serve it with ``tpucompile.serving.load_served`` (no torch) or ``tpucompile.load``."""
    from tpucompile.exporting import writer  # torch is imported only when a model is exported

    return writer.export(model, example_args, path, dynamic_shapes, buckets, platforms)


def load(path: str | os.PathLike) -> Any:
    """The program ``tpucompile.export`` wrote to ``path``, as a callable on torch tensors (weights loaded once)."""
    from tpucompile.exporting import torch_loader

    return torch_loader.load(path)


def memory_stats(device: Any = None) -> dict[str, Any]:
    """Device memory tpucompile holds now, its high-water mark, and each compiled graph's program needs.

    ``held``: bytes of the device buffers tpucompile keeps, by use: ``parameters`` and ``inputs`` (arguments
    imported for a program and kept for its next call: the buffer of each argument slot's last tensor),
    ``constants`` (large constants a graph passes to its program), ``saved_activations`` (values a training
    forward computed, kept as device buffers until the backward takes them), ``outputs`` (program results
    returned as torch tensors, while their memory lives, gradients that ``.grad`` holds included), and their
    ``total``. ``shared``: the part of each that is a torch tensor's own memory (imports without a copy),
    which torch counts too; ``own``: the rest, memory the runtime allocated. On the CPU imports share memory
    (but for misaligned tensors, which are copied): there tpucompile holds parameters, inputs and constants
    only in that it keeps those tensors alive, and ``own`` is what it added to the process. ``peak``: the
    high-water marks of ``held`` and ``own`` since ``reset_peak_memory_stats()`` (buffers between and around
    calls; a program's temporaries while it runs are not in them). ``graphs``: per compiled graph, by the name
    logs use ("graph 0 (forward)"), XLA's analysis of its program in bytes per device: ``arguments``,
    ``outputs``, ``aliased`` (outputs written over donated arguments), ``temporaries``, ``generated_code``,
    the largest over its live ``executables``.

    ``device``: None for all devices; a jax device; a name as torch spells it, ``"cpu:0"``, ``"tpu:1"``,
    ``"cuda:0"`` (jax's ``gpu:0``), or a platform alone (``"cpu"``: its devices together, peaks summed); or an
    int, the device of that id on the platform tpucompile runs on. The result's ``device`` names the
    selection (``"all"``, ``"cpu:0"``); a device tpucompile never used holds nothing. Programs over a mesh
    count each device's shards on that device.
    """
    return memory_accounting.snapshot(device)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Start ``memory_stats()["peak"]`` again from what is held now (on ``device``, or on all)."""
    memory_accounting.reset_peak(device)


__all__ = [
    "CacheMissError",
    "CompileError",
    "LoweringError",
    "Mesh",
    "Options",
    "OptionsError",
    "ShardPlan",
    "ShardingError",
    "TpuCompileError",
    "TpuCompileWarning",
    "UnsupportedOpError",
    "__version__",
    "data_parallel",
    "export",
    "fully_sharded",
    "load",
    "memory_stats",
    "register_lowering",
    "remove_lowering",
    "reset_peak_memory_stats",
    "stats",
    "tensor_parallel",
]
