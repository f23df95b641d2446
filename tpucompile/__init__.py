"""tpucompile: a torch.compile backend that lowers PyTorch graphs to StableHLO and runs them with XLA.

    torch.compile(model, backend="tpucompile")

The backend name is registered through the ``torch_dynamo_backends`` entry point, so no import is needed.
"""

__version__ = "0.1.0"

import os
from collections.abc import Sequence
from typing import Any

from tpucompile import compile_stats
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
    ``recompiles`` (one reason per compile of a graph after its first: the new sizes or bucket) and
    ``bucket_hits`` (calls served by the executable of a bucket compiled before)."""
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
    "register_lowering",
    "remove_lowering",
    "stats",
    "tensor_parallel",
]
