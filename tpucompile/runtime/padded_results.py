"""Bucketed results that come back as inputs, handed to the next program as the padded buffers they were cut from.

A bucketed program returns each runtime-sized result padded to its bucket, and the caller gets it cut to its
actual sizes. A value that comes back as an input of a bucketed graph (a key/value cache, which each decoding
step extends and the next step reads) would then be padded to its bucket again: a second copy of the whole
value on every call, beside the cut. The programs read nothing past a dimension's actual extent (XLA's
dynamic padder masks the padding wherever an op would read it, ``lowering/dynamic_sizes``), so the buffer the
value was cut from is a padded input as good as a fresh pad, and crosses without a copy.

Holding the padded buffer of every result would keep two copies of each output alive (a language model's
logits included) for as long as the caller keeps it, so a graph output keeps its buffers only once it has been
seen coming back: each cut is noted with the output it came from (``ResultSlot``), and the first call that
receives a noted cut as an input marks that output as fed back. That call still pads; from the next one on,
the output's cuts carry their buffers. Noting costs a weak reference per cut, more than padding a small value
again, so only cuts of ``NOTED_ELEMENTS`` or more are noted, and every cut of an output that extends an
argument. Such a value (a cache grows by a position per decoding step) comes back padded past its bucket by
as much as it grew, so its graph takes that argument padded so in every bucket (``growing_arguments``, read
from the graph's sizes), and the concatenation that extends it writes into the argument's buffer in place
(``lowering/grown_in_place``).

A cut is known by its storage (autograd and Dynamo hand the same memory back under other tensor objects) and
served only while a tensor over that storage has the cut's offset, sizes, contiguity and version: an in-place
change to the cut, or a view of part of it, pads as before. The entry dies with the storage.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx

from tpucompile.contracts.size_expressions import symbolic_dims
from tpucompile.runtime.host_copies import SERIAL_ELEMENTS


class ResultSlot:
    """One output of a bucketed graph: whether its values have come back as a bucketed graph's inputs."""

    __slots__ = ("always_noted", "fed_back")

    def __init__(self) -> None:
        self.fed_back = False
        self.always_noted = False
        """Whether every cut of this output is noted, whatever its size (an output that extends an argument)."""


class Cut(weakref.ref):
    """A weak reference to a cut's storage, carrying what the cut was made from: its output, the padded
    buffer (None until the output is known to come back), the buffer's shape, and the cut's shape and version."""

    __slots__ = ("buffer", "key", "padded_shape", "shape", "slot", "version")


_cuts: dict[int, Cut] = {}
"""id(storage) -> the cut over that storage, for every cut of a bucketed result still alive."""


def _drop(ref: Cut) -> None:
    if _cuts.get(ref.key) is ref:
        del _cuts[ref.key]


def note_cut(tensor: torch.Tensor, slot: ResultSlot, buffer: Any) -> None:
    """Record that ``tensor`` (a new contiguous tensor of its own storage) was cut from ``buffer``, the padded
    result of ``slot``; the buffer is held with it only when the slot's values are known to come back."""
    storage = tensor.untyped_storage()
    ref = Cut(storage, _drop)
    ref.key = id(storage)
    ref.slot = slot
    ref.buffer = buffer if slot.fed_back else None
    ref.padded_shape = tuple(buffer.shape)
    ref.shape = tensor.shape
    ref.version = tensor._version
    _cuts[ref.key] = ref


def find(value: Any) -> Cut | None:
    """The cut ``value`` is, when it is a tensor over a noted cut's whole storage, unchanged since the cut."""
    if not _cuts or not isinstance(value, torch.Tensor):
        return None
    storage = value.untyped_storage()
    cut = _cuts.get(id(storage))
    if (cut is None or cut() is not storage or cut.shape != value.shape or cut.version != value._version
            or value.storage_offset() != 0 or not value.is_contiguous()):
        return None
    return cut


_taking = threading.Lock()


def take_buffer(cut: Cut) -> Any | None:
    """``cut``'s padded buffer, which the cut holds no more: for a program that takes it over (donation), so
    that no later call, in this thread or another, passes it again."""
    with _taking:
        buffer, cut.buffer = cut.buffer, None
    return buffer


def held_count() -> int:
    """How many cuts hold their padded buffers now."""
    return sum(1 for cut in _cuts.values() if cut.buffer is not None)


NOTED_ELEMENTS = SERIAL_ELEMENTS
"""Cuts of at least this many elements are noted for a call that takes them back (``note_cut``), besides
every cut of an output that extends an argument: below it, padding such a value again on the calling thread
costs less than noting each cut (a weak reference per result)."""

MAX_HEADROOM = 8
"""The most, per dimension, that an argument is taken padded past its bucket: a decoding step's few new
positions."""


def growing_arguments(placeholders: Sequence[torch.fx.Node], outputs: Sequence[Any],
                      runtime: frozenset[sympy.Symbol]) -> tuple[dict[int, tuple[int, ...]], set[int]]:
    """Per runtime-sized argument that some result extends, the extension per dimension: a result of the
    argument's dtype and rank whose every size is the argument's plus a constant from 0 to ``MAX_HEADROOM``,
    more along some runtime-sized dimension (a key/value cache of length ``s`` returned with ``s + 1``). Its
    program returns that result padded to the bucket plus the extension, so the next call, which passes the
    result back, finds it padded as the argument is taken only if the argument is taken so padded too. Also
    the indices of the outputs that extend an argument."""
    results = [(index, out.meta.get("val")) for index, out in enumerate(outputs) if isinstance(out, torch.fx.Node)]
    results = [(index, val) for index, val in results
               if isinstance(val, torch.Tensor) and symbolic_dims(val, runtime)]
    found, extending = {}, set()
    for position, node in enumerate(placeholders):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not symbolic_dims(val, runtime):
            continue
        for index, result in results:
            extra = _extension(val, result)
            if extra is not None:
                found.setdefault(position, extra)
                extending.add(index)
    return found, extending


def _extension(argument: torch.Tensor, result: torch.Tensor) -> tuple[int, ...] | None:
    """How much larger ``result`` is than ``argument`` per dimension, when the two have the same fixed sizes
    and every difference of their symbolic sizes is a constant from 0 to ``MAX_HEADROOM``, some not 0; None
    otherwise."""
    if result.dtype != argument.dtype or result.dim() != argument.dim():
        return None
    extra = []
    for have, grown in zip(argument.shape, result.shape, strict=True):
        difference = sympy.sympify(_expr(grown) - _expr(have))
        if not difference.is_Integer or not 0 <= int(difference) <= MAX_HEADROOM or (
                int(difference) and not isinstance(have, torch.SymInt)):
            return None
        extra.append(int(difference))
    return tuple(extra) if any(extra) else None


def _expr(size: Any) -> sympy.Expr:
    return sympy.sympify(size.node.expr) if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
