"""The loops rolled layers become, as the graph rewrites write them and the lowering reads them.

``torch.ops.higher_order.scan(body, init, xs, shared)`` is PyTorch's own: ``body(*carry, *x[i], *shared)``
returns ``(*carry, *y)`` for each ``i``; the op returns the last carry and the ``y`` stacked. AOTAutograd writes
the backward of one as a scan over ``flip``ped stacks whose stacked results it flips back. ``scan_in_reverse``
is that scan with the flips folded in: stacked inputs marked reversed are read back to front and stacked
results marked reversed are written back to front, which a loop does by its index instead of by copying
each stack. Its eager form (a graph run by PyTorch) flips explicitly, so both spell the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

SCAN = torch.ops.higher_order.scan

TRIPS_PREFIX = "rolled loop x"
"""The loop's location names its trip count (``rolled loop x16``), which XLA keeps as the while instruction's
``op_name``: the optimised HLO of a TPU program states no trip count of its own, and cost figures that count a
loop's body once are multiplied by it (the runtime's cycle estimate, the benchmarks)."""


def scan_in_reverse(body: Any, init: Sequence[torch.Tensor], xs: Sequence[torch.Tensor],
                    shared: Sequence[Any], reversed_xs: Sequence[bool], reversed_ys: Sequence[bool]
                    ) -> list[torch.Tensor]:
    """``scan(body, init, xs, shared)`` reading the ``xs`` marked in ``reversed_xs`` from their last slice to
    their first, with the stacked results marked in ``reversed_ys`` returned last iteration first."""
    flipped = [x.flip(0) if reverse else x for x, reverse in zip(xs, reversed_xs, strict=True)]
    results = list(SCAN(body, list(init), flipped, list(shared)))
    carries, stacked = results[:len(init)], results[len(init):]
    return [*carries, *(y.flip(0) if reverse else y for y, reverse in zip(stacked, reversed_ys, strict=True))]


def is_loop(node: torch.fx.Node) -> bool:
    """Whether ``node`` runs a rolled loop (a scan, or a scan with its flips folded in)."""
    return node.op == "call_function" and (node.target is SCAN or node.target is scan_in_reverse)


def loop_parts(node: torch.fx.Node) -> tuple[Any, list[Any], list[Any], list[Any], tuple[bool, ...], tuple[bool, ...]]:
    """A loop node's (body reference, init, xs, shared, reversed_xs, reversed_ys)."""
    body, init, xs, shared = node.args[:4]
    if node.target is scan_in_reverse:
        reversed_xs, reversed_ys = node.args[4], node.args[5]
    else:
        stacked_results = len(node.meta["val"]) - len(init) if "val" in node.meta else 0
        reversed_xs, reversed_ys = (False,) * len(xs), (False,) * stacked_results
    return body, list(init), list(xs), list(shared), tuple(reversed_xs), tuple(reversed_ys)


def body_of(node: torch.fx.Node) -> torch.fx.GraphModule:
    """The graph a loop node runs per iteration (its first argument names a submodule of the node's graph)."""
    reference = node.args[0]
    owner = node.graph.owning_module
    if not isinstance(reference, torch.fx.Node) or reference.op != "get_attr" or owner is None:
        raise TypeError(f"loop {node.name} does not name its body as a submodule")
    return owner.get_submodule(str(reference.target))
