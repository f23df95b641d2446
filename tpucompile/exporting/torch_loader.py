"""``tpucompile.load``: an export directory as a torch callable, for checking an artifact against the model
or serving it from a process that has torch anyway. Tensors cross to numpy and back; the programs run through
``tpucompile.serving``, so this is exactly what a jax-only server computes."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from tpucompile.serving import ServedProgram


class LoadedExport:
    """Call it like the exported model (its positional tensor arguments); returns its outputs in the model's
    own structure (a tensor, a tuple, a dict) as torch tensors on the CPU. The weights are loaded once."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.served = ServedProgram(path)
        self.manifest = self.served.manifest
        spec = self.manifest.get("out_spec")
        self._out_spec = torch.utils._pytree.treespec_loads(spec) if spec else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        arrays = [_to_numpy(value) for value in flat]
        outputs = [_to_torch(out) for out in self.served(*arrays)]
        if self._out_spec is None:
            return tuple(outputs)
        return torch.utils._pytree.tree_unflatten(outputs, self._out_spec)


def _to_numpy(value: Any) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"an exported program takes tensors, got {type(value).__name__}")
    value = value.detach().cpu()
    if value.dtype is torch.bfloat16:
        import ml_dtypes

        return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return value.numpy()


def _to_torch(array: np.ndarray) -> torch.Tensor:
    array = np.array(array)  # writable, owned by torch from here
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def load(path: str | os.PathLike) -> LoadedExport:
    """The program exported to ``path`` as a callable taking and returning torch tensors."""
    return LoadedExport(path)
