"""Tracing graphs whose inputs are ``meta`` tensors (weights that never exist: compile-only runs) into the same
ATen graphs that real tensors give.

PyTorch registers Python ``Meta`` kernels for some ops that are otherwise composite (decomposed by their
``CompositeImplicitAutograd`` kernel, which autograd differentiates through). Under the Python dispatcher
AOTAutograd traces with, such a kernel takes precedence for ``meta`` tensors, and since none of them has an
autograd formula, the result has no gradient: with torch 2.13 a ``cross_entropy`` inside a compiled model on
meta weights leaves every parameter's gradient ``None`` (the backward graph returns nothing), under any
AOTAutograd backend. Hiding those kernels while a meta graph is traced lets the composite decompose as it does
for a CPU or TPU tensor, so the traced graphs, and so the cache keys, are the ones a run on real weights makes.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._C import DispatchKey

_lock = threading.Lock()


@functools.cache
def _composite_ops_with_meta_kernels() -> tuple[torch._ops.OpOverload, ...]:
    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if DispatchKey.Meta in op.py_kernels and torch._C._dispatch_has_kernel_for_dispatch_key(
                    op.name(), "CompositeImplicitAutograd"):
                found.append(op)
    return tuple(found)


def has_meta_inputs(example_inputs: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in example_inputs)


@contextlib.contextmanager
def traced_like_real_tensors(example_inputs: Sequence[Any]) -> Iterator[None]:
    """While tracing a graph with meta inputs, composite ops decompose as they do for real tensors; a no-op
    for other graphs."""
    if not has_meta_inputs(example_inputs):
        yield
        return
    with _lock:
        hidden = [(op, op.py_kernels.pop(DispatchKey.Meta)) for op in _composite_ops_with_meta_kernels()
                  if DispatchKey.Meta in op.py_kernels]
        for op, _ in hidden:
            op._dispatch_cache.clear()
        try:
            yield
        finally:
            for op, kernel in hidden:
                op.py_kernels[DispatchKey.Meta] = kernel
                op._dispatch_cache.clear()
