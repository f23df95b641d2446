"""ATen → ATen passes over the functional graphs AOTAutograd makes, run before lowering.

Each pass is a small function with its own test; ``run_passes`` is the order the compiler uses. Rewrites of
Dynamo's torch-level graph (before AOTAutograd) live in ``tpucompile.frontend``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx

from tpucompile.passes.concat_sums import sum_concatenations_by_part
from tpucompile.passes.constants import lift_large_constants
from tpucompile.passes.dead_code import eliminate_dead_code
from tpucompile.passes.gradient_order import order_parameter_gradients
from tpucompile.passes.noop_views import remove_noop_views
from tpucompile.passes.partition import isolate_node, partition_supported
from tpucompile.passes.saved_values import saved_value_mismatch
from tpucompile.sharding.annotate import annotate_shardings, remember_output_names
from tpucompile.sharding.plan import Mesh, ShardPlan


@dataclasses.dataclass
class PassResult:
    lifted_constants: list[torch.Tensor]
    """Constants turned into trailing arguments (see ``lift_large_constants``)."""


def run_passes(
    gm: torch.fx.GraphModule,
    embed_constant_limit: int,
    after_pass: Callable[[str, torch.fx.GraphModule], None] | None = None,
    mesh: Mesh | None = None,
    plan: ShardPlan | None = None,
    processes: int = 1,
    sum_concatenations: bool = True,
    order_gradients: bool = False,
) -> PassResult:
    """Clean ``gm`` in place: drop no-op views, sum concatenations part by part (``sum_concatenations``),
    drop dead code, compute a backward's parameter gradients in the graph's order (``order_gradients``), lift
    large constants; with a ``mesh``, annotate the inputs and outputs with their
    shardings (``plan``: a plan bound to the graph's Dynamo inputs; ``processes``: how many processes share
    the mesh).

    ``after_pass(name, gm)``, when given, sees the graph after each pass (dumps show every step).
    """
    remember_output_names(gm)  # the backward names its saved inputs as AOTAutograd named the forward's outputs
    remove_noop_views(gm)
    if after_pass:
        after_pass("remove_noop_views", gm)
    if sum_concatenations:
        sum_concatenations_by_part(gm)
        if after_pass:
            after_pass("sum_concatenations_by_part", gm)
    eliminate_dead_code(gm)
    if after_pass:
        after_pass("eliminate_dead_code", gm)
    if order_gradients and order_parameter_gradients(gm) and after_pass:
        after_pass("order_parameter_gradients", gm)
    lifted = lift_large_constants(gm, embed_constant_limit)
    if after_pass:
        after_pass("lift_large_constants", gm)
    if mesh is not None:
        annotate_shardings(gm, mesh, plan or ShardPlan(), processes)
        if after_pass:
            after_pass("annotate_shardings", gm)
    return PassResult(lifted_constants=lifted)


__all__ = [
    "PassResult",
    "eliminate_dead_code",
    "isolate_node",
    "lift_large_constants",
    "order_parameter_gradients",
    "partition_supported",
    "remove_noop_views",
    "run_passes",
    "saved_value_mismatch",
    "sum_concatenations_by_part",
]
