"""What each input of the ATen graphs AOTAutograd makes from a Dynamo graph holds: a parameter, a parameter's
gradient, an optimiser's state, or another input (the batch, a buffer). Step reports count per-chip memory by
these uses.

AOTAutograd's graphs take the Dynamo graph's attributes first (a compiled optimiser step holds the parameters
and its state as attributes), then its inputs; ``primals_N`` / ``argN_1`` is the N-th of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from tpucompile.contracts.input_uses import GRADIENTS, INPUTS, OPTIMIZER_STATE, PARAMETERS, USES_KEY
from tpucompile.sharding.names import lifted_attributes

__all__ = ["USES_KEY", "graph_input_uses"]


def graph_input_uses(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[str | None, ...]:
    """The use of every input AOTAutograd passes to the graphs of ``gm`` (None for non-tensors)."""
    lifted = lifted_attributes(gm)
    parameters = [t for _, t in lifted if isinstance(t, torch.nn.Parameter)]
    gradients = {id(p.grad) for p in parameters if p.grad is not None}
    uses: list[str | None] = [PARAMETERS if isinstance(t, torch.nn.Parameter) else OPTIMIZER_STATE for _, t in lifted]
    for example in example_inputs:
        if not isinstance(example, torch.Tensor):
            uses.append(None)
        elif isinstance(example, torch.nn.Parameter):
            uses.append(PARAMETERS)
        elif id(example) in gradients:
            uses.append(GRADIENTS)
        else:
            uses.append(INPUTS)
    return tuple(uses)
