"""tpucompile: a torch.compile backend that lowers PyTorch graphs to StableHLO and runs them with XLA.

    torch.compile(model, backend="tpucompile")

The backend name is registered through the ``torch_dynamo_backends`` entry point, so no import is needed.
"""

__version__ = "0.1.0"

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
    "fully_sharded",
    "tensor_parallel",
]
