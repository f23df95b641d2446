"""Whether a Dynamo graph runs a ``torch.func`` transform (``grad``, ``grad_and_value``, ``vjp``) in itself.

Such a graph differentiates with functorch, which cannot differentiate an ``autograd.Function`` or a custom
op's autograd formula defined the usual way: rewrites that route calls to one (attention's kernel op,
interpolation's product gradient) leave the calls of such a graph as they are.
"""

from __future__ import annotations

import torch
import torch.fx


def runs_functorch_transform(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is torch._C._functorch._grad_increment_nesting
               for n in gm.graph.nodes)
