"""A bucket's padded inputs written into one tensor per input instead of a new tensor per call.

A bucketed call pads each runtime-sized input to its bucket. A new padded tensor on every call is a new device
buffer on every call: an allocation, an import and its bookkeeping (remembered for reuse, counted for
``memory_stats()``, watched for its death), about 10 us of a small step's call. Where a device buffer shares
the tensor's memory and each program has finished reading its arguments when its call returns (the CPU,
``resident.shares_host_memory``), one zero-padded tensor per bucket and input takes each call's values
instead: the executable finds the buffer it imported the first time, and the copy is the one the pad made.

A staged tensor serves one call at a time: a call that finds it taken (another thread's program still reading
it) pads a tensor of its own, as before.
"""

from __future__ import annotations

import threading

import torch

from tpucompile.runtime import host_copies


class StagedInput:
    """One input's padded tensor for one bucket, zero outside the values last written."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.tensor = torch.zeros(shape, dtype=dtype)
        self._written = (0,) * len(shape)
        """The leading region that may hold values other than zero: the shape of the last input written."""
        self._lock = threading.Lock()

    def take(self, source: torch.Tensor) -> bool:
        """Write ``source`` zero-padded into the tensor and hold it for this call (``release`` after the
        program ran); False, writing nothing, when it is held or ``source`` does not fit it."""
        tensor = self.tensor
        if (source.dtype is not tensor.dtype or source.device.type != "cpu" or source.dim() != tensor.dim()
                or any(have > room for have, room in zip(source.shape, tensor.shape, strict=True))):
            return False
        if not self._lock.acquire(blocking=False):
            return False
        shape = tuple(source.shape)
        if any(before > now for before, now in zip(self._written, shape, strict=True)):
            host_copies.zero(tensor)  # the last input reached past this one somewhere: clear it all
        host_copies.write_leading(tensor, source)
        self._written = shape
        return True

    def release(self) -> None:
        """Let the next call write the tensor (its program has read it)."""
        self._lock.release()
