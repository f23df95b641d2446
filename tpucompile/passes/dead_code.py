"""Remove nodes whose results nobody uses (functional graphs have no hidden side effects)."""

from __future__ import annotations

import torch.fx


def eliminate_dead_code(gm: torch.fx.GraphModule) -> bool:
    """Drop unused pure nodes; placeholders stay so the calling convention does not change."""
    changed = gm.graph.eliminate_dead_code()
    if changed:
        gm.recompile()
    return changed
