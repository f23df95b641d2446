"""Device buffers of live torch tensors, shared by every executable that runs on one device.

Importing a tensor into PJRT has a cost per tensor, and a training step hands many tensors across twice:
the weights go into the forward and again into the backward, and the activations the forward saved come
back into the backward. Remembering, per live tensor, the buffer it was last imported as (or the buffer it was
exported from) lets each of them cross once. An entry is served only while the tensor is the same contiguous
object with the same storage, dtype and sizes, and is dropped when the tensor dies.

A buffer that shares the tensor's memory (DLPack on the CPU, where nothing runs asynchronously) sees every
in-place change, so it stays valid when the version counter moves: weights that the optimiser updates in
place cross once for the whole run. A buffer that holds a copy (another device, a misaligned tensor) is served
only while the version counter is the one it was copied at.

An imported buffer holds an alias of the tensor (through its DLPack capsule): its memory, not the tensor
itself, whose Python object torch would otherwise keep alive while the buffer lives. This table holds
imported buffers only weakly: the executable that imported one keeps it, until the argument slot it was
imported for moves on to another tensor or the tensor dies. A buffer a program returned does not hold the
torch tensor made from it, so that one is held here until the tensor dies.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tpucompile.runtime.targets.local import runs_inline


class _TensorRef(weakref.ref):
    """A weak reference that knows its entry's key, so that its callback can drop the entry."""

    __slots__ = ("key",)


class ResidentBuffers:
    """Buffers on one device, keyed by the torch tensors they hold the values of."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, ...]] = {}
        """id(tensor) -> (weak ref to the tensor, version or None when the buffer shares its memory, data
        pointer, dtype, sizes, buffer held strongly or None, weak ref to the buffer or None)."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tensor: torch.Tensor) -> Any | None:
        """The buffer remembered for ``tensor``, or None when there is none or the tensor changed since."""
        entry = self._entries.get(id(tensor))
        if (
            entry is not None
            and entry[0]() is tensor
            and (entry[1] is None or entry[1] == tensor._version)
            and entry[2] == tensor.data_ptr()
            and entry[3] is tensor.dtype
            and entry[4] == tensor.shape
            and tensor.is_contiguous()
        ):
            buffer = entry[5]
            return entry[6]() if buffer is None else buffer
        return None

    def remember(self, tensor: torch.Tensor, buffer: Any, *, shares_memory: bool, imported: bool) -> None:
        """Record that ``buffer`` holds ``tensor``'s present values (``shares_memory``: and always will);
        ``imported``: the buffer was made from the tensor, and is held weakly."""
        if not tensor.is_contiguous():
            return
        key = id(tensor)
        ref = _TensorRef(tensor, self._drop)
        ref.key = key
        version = None if shares_memory else tensor._version
        held = (None, weakref.ref(buffer)) if imported else (buffer, None)
        self._entries[key] = (ref, version, tensor.data_ptr(), tensor.dtype, tensor.shape, *held)

    def _drop(self, ref: _TensorRef) -> None:
        entry = self._entries.get(ref.key)
        if entry is not None and entry[0] is ref:
            del self._entries[ref.key]


_BY_DEVICE: dict[Any, ResidentBuffers] = {}


def resident_buffers(device: Any) -> ResidentBuffers:
    """The process's buffers for ``device``."""
    found = _BY_DEVICE.get(device)
    if found is None:
        found = _BY_DEVICE[device] = ResidentBuffers()
    return found


def shares_host_memory(device: Any) -> bool:
    """Whether buffers on ``device`` that alias a tensor's memory can be reused after in-place changes: on the
    CPU, with programs run inline (each call has finished reading its inputs when it returns)."""
    return device.platform == "cpu" and runs_inline(device.client)
