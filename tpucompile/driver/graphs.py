"""Compile one ATen graph: passes, then the whole graph as one program, or, when some of its ops cannot be
lowered or have data-dependent result sizes, as compiled regions with those ops between them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.fx

from tpucompile import diagnostics
from tpucompile.config import Options
from tpucompile.driver import host_kernel_upgrades
from tpucompile.driver.eager_fallback import compile_partitioned
from tpucompile.driver.events import count_graph, record_graph, recording
from tpucompile.driver.resolved_targets import CompileTargets, resolve_targets
from tpucompile.driver.shape_dispatch import compile_region
from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import jax_bridge
from tpucompile.lowering.graph import has_data_dependent_size, unsupported_reason
from tpucompile.passes import run_passes
from tpucompile.runtime import process_count


def compile_graph(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Options, name: str,
    targets: CompileTargets | None = None,
) -> Callable[[list[Any]], list[Any]]:
    """The boxed callable that runs ``gm`` (a functional ATen graph from AOTAutograd) on XLA, for ``targets``
    (the backend resolves them once per Dynamo graph; resolved from ``options`` when not given).

    Ops tpucompile cannot lower either fail the compile (``fallback="error"``) or run in eager PyTorch
    between compiled regions (``fallback="eager"``, the default). Ops whose result size depends on the data
    (``nonzero``, ``unique``) are compiled as regions of their own, whose padded results are cut to size on
    the host before the next region sees them.
    """
    targets = targets or resolve_targets(options)
    with (jax_bridge.target_platform(targets.lowered_for.platform),  # which custom ops have a JAX lowering here
          jax_bridge.kernels_interpreted(options.attention == "interpret"),
          host_kernel_upgrades.compiling()):
        return _compile_graph(gm, targets, options, name)


def _compile_graph(gm: torch.fx.GraphModule, targets: CompileTargets, options: Options, name: str
                   ) -> Callable[[list[Any]], list[Any]]:
    count_graph()
    record_graph(name, "aot_autograd", gm)
    after_pass = functools.partial(record_graph, name) if recording() else None
    passes = run_passes(gm, options.embed_constant_limit, after_pass, options.mesh, options.shard,
                        process_count() if options.mesh is not None else 1, options.sum_concat_by_part,
                        order_gradients=options.recompute_product_operands)
    unsupported = [n for n in gm.graph.nodes if unsupported_reason(n) is not None]
    data_dependent = [n for n in gm.graph.nodes if has_data_dependent_size(n)]
    if not unsupported and not data_dependent:
        return compile_region(gm, targets, options, name, passes.lifted_constants)
    if options.mesh is not None:
        node = (unsupported or data_dependent)[0]
        raise UnsupportedOpError(f"a sharded graph compiles as one program, and this one cannot: "
                                 f"{unsupported_reason(node) or diagnostics.describe_node(node)} has "
                                 f"{'no lowering' if unsupported else 'a data-dependent result size'}")
    return compile_partitioned(gm, name, unsupported, options.fallback, passes.lifted_constants,
                               lambda region, region_name: compile_region(region, targets, options, region_name, []))
