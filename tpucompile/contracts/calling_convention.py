"""How a compiled program's arguments and results map to its graph's, shared by the lowering (which writes the
mapping) and the executables (which follow it on every call).

An input position is the index of the graph argument a program argument comes from, or ``SEED_POSITION``. An
output plan is one ``OutputSlot`` per graph output; the executables turn it once into ``call_plan`` tuples,
the form their per-call loop reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

RESULT, INPUT, CONSTANT, TRIMMED, PART = 0, 1, 2, 3, 4
"""The kinds of ``call_plan`` entries: program result i; argument j as is; a constant; a padded result cut to
sizes that other results hold (value: (result index, ((dimension, size result index), ...))); one layer of a
stacked result, a view of it (value: (result index, layer))."""


@dataclasses.dataclass(frozen=True)
class OutputSlot:
    """Where one graph output comes from: ``result`` i of the program, ``input`` j as is, or a ``constant``."""

    kind: str
    index: int = 0
    value: Any = None
    trim: tuple[tuple[int, int], ...] = ()
    """For a padded result: (dimension, index of the int64 result holding that dimension's actual size)."""
    part: int | None = None
    """For a result stacked along its first dimension: the output is its entry ``part`` of that dimension."""


def call_plan(slots: Sequence[OutputSlot]) -> list[tuple[int, Any]]:
    """The output plan as (kind, value) pairs, the form an executable reads on every call."""
    plan: list[tuple[int, Any]] = []
    for slot in slots:
        if slot.kind == "result" and slot.part is not None:
            plan.append((PART, (slot.index, slot.part)))
        elif slot.kind == "result":
            plan.append((TRIMMED, (slot.index, slot.trim)) if slot.trim else (RESULT, slot.index))
        elif slot.kind == "input":
            plan.append((INPUT, slot.index))
        elif slot.kind == "constant":
            plan.append((CONSTANT, slot.value))
        else:
            raise ValueError(f"unknown output slot kind {slot.kind!r}")
    return plan
SEED_POSITION = -1
"""An input position that is not an argument: a fresh seed for the program's random ops."""


def draw_seed() -> torch.Tensor:
    """Two 64-bit words from torch's default generator, so ``torch.manual_seed`` governs compiled RNG too."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)
