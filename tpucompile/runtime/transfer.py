"""Moving tensors between torch and PJRT buffers through DLPack, without copies where memory is shared.

jaxlib's own DLPack entry points are used directly: they skip the per-tensor Python work of
``jax.dlpack.from_dlpack``/``torch.from_dlpack``, which matters when a graph has dozens of inputs.
Non-contiguous tensors are made contiguous first, and lazily conjugated or negated ones resolved: either
would otherwise be imported with a layout or values that the executable ignores, silently giving wrong
results.
"""

from __future__ import annotations

import jax
import torch
import torch.utils.dlpack
from jaxlib import xla_client

_import_dlpack = xla_client._xla.dlpack_managed_tensor_to_buffer
_export_dlpack = xla_client._xla.buffer_to_dlpack_managed_tensor
_capsule_to_tensor = torch.utils.dlpack.from_dlpack
# The C entry point skips ``Tensor.__dlpack__``'s Python-level argument handling (paid once per tensor).
# It also accepts tensors that require grad, which ``__dlpack__`` refuses.
_tensor_to_capsule = getattr(torch._C, "_to_dlpack", None) or (lambda tensor: tensor.detach().__dlpack__())


def shares_tensor_memory(tensor: torch.Tensor, device: object) -> bool:
    """Whether ``to_buffer(tensor, device)`` gives a buffer over the tensor's own memory (DLPack, no copy)."""
    return not (tensor.is_cpu and device.platform != "cpu")


def to_buffer(tensor: torch.Tensor, device: object) -> object:
    """A PJRT buffer holding ``tensor``'s values on ``device`` (zero-copy when the memory is shared)."""
    if tensor.is_conj() or tensor.is_neg():
        # DLPack carries no conjugate or negative bit: the values the tensor shows are written out
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if not shares_tensor_memory(tensor, device):
        return jax.device_put(_as_numpy(tensor.detach()), device)
    # An alias of the tensor crosses, not the tensor: the capsule's reference would otherwise keep the tensor's
    # Python object alive (PyTorch preserves it while C++ holds the tensor) for as long as the buffer lives,
    # and a buffer kept for a tensor could then never see the tensor die. The alias holds only the memory.
    return _import_dlpack(_tensor_to_capsule(tensor.detach()), device, None)


def _as_numpy(tensor: torch.Tensor) -> object:
    if tensor.dtype is torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_tensor(buffer: object) -> torch.Tensor:
    """A torch tensor sharing ``buffer``'s memory (it keeps the buffer alive)."""
    return _capsule_to_tensor(_export_dlpack(buffer))


def copy_buffer(buffer: object, device: object) -> object:
    """A copy of a device buffer on ``device`` that shares no memory with it (for a program that will take
    the copy over)."""
    return jax.device_put(buffer, device, may_alias=False)
