"""An ordering constraint the graph rewrites write and the lowering reads.

``together(*values)`` returns ``values`` unchanged, but none of its results exists before all of ``values`` are
computed: the lowering emits one ``stablehlo.optimization_barrier`` over them, which XLA's scheduler cannot see
through. Its eager form (a graph run by PyTorch) is the identity.
"""

from __future__ import annotations

import torch


def together(*values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``values``, each to be read only once all of them have been computed."""
    return values
