"""Export for serving: a model becomes a directory of StableHLO programs in jax.export's serialisation,
safetensors weights and a manifest, which ``tpucompile.serving`` runs with numpy and jax alone.

    tracing       torch.export, the decomposition table, and the refusals (ops an artifact cannot run)
    jax_program   a lowered StableHLO module as a ``jax.export.Exported``
    writer        lowering per bucket, the files, the manifest
    torch_loader  ``tpucompile.load``: the directory as a torch callable
"""

from tpucompile.exporting.torch_loader import LoadedExport, load
from tpucompile.exporting.writer import export

__all__ = ["LoadedExport", "export", "load"]
