"""Walking an MLIR module's operations, nested regions included (the bindings have no walk of their own)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def walk_operations(operation: Any) -> Iterator[Any]:
    """Every operation inside ``operation``'s regions, depth first, parents before their children."""
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op.operation
                yield from walk_operations(op.operation)
