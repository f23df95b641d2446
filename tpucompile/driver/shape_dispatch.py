"""Which executable a call runs: a graph with only static sizes is compiled once, now; one with symbolic sizes
per bucket of sizes (padded, when asked for and exact under padding) or per concrete set of sizes seen at call
time."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from tpucompile.config import Options, fixed_shapes_in_place_for, products_on_padding_for
from tpucompile.contracts.saved_handoff import SAVED_HANDOFF
from tpucompile.contracts.size_expressions import runtime_symbols
from tpucompile.driver.executable_assembly import build_executable
from tpucompile.driver.resolved_targets import CompileTargets
from tpucompile.errors import TpuCompileWarning
from tpucompile.lowering import ShapeBindings, is_symbolic, padding_safety
from tpucompile.runtime import GraphExecutable, ShapeSpecializer
from tpucompile.runtime.buckets import BucketedGraph
from tpucompile.runtime.input_views import input_views

log = logging.getLogger("tpucompile")


def compile_region(
    gm: torch.fx.GraphModule, targets: CompileTargets, options: Options, name: str,
    lifted_constants: list[torch.Tensor],
) -> Callable[[list[Any]], list[Any]]:
    """Lower and compile a fully supported graph, now (static sizes) or per call shape (symbolic sizes)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    metas = [n.meta.get("val") for n in placeholders]
    user_arg_count = len(placeholders) - len(lifted_constants)

    def build(bindings: ShapeBindings, constants: list[torch.Tensor] = lifted_constants) -> Any:
        return build_executable(gm, bindings, constants, targets, options, name)

    if not any(is_symbolic(m) for m in metas):
        return build(ShapeBindings())
    if _bucketable(gm, metas, targets, options, name):  # the bucketed graph pads the constants with the rest
        def build_for_bucket(bounds: dict, runtime: frozenset, input_extents: dict) -> GraphExecutable:
            platform = targets.lowered_for.platform
            return build(ShapeBindings(
                bounds, runtime, options.bucket_unmerged_products,
                fixed_shapes_in_place_for(options.bucket_fixed_shapes_in_place, platform),
                products_on_padding_for(options.bucket_products_on_padding, platform), input_extents), [])

        return BucketedGraph(name, gm, build_for_bucket, lifted_constants, options.buckets,
                             options.bucket_minimum, options.max_shape_specializations,
                             gm.meta.get(SAVED_HANDOFF) if options.bucket_saved_padded else None,
                             stage_inputs=options.bucket_staged_inputs,
                             reuse_padded_results=options.bucket_reuse_padded_results)

    def build_for_call(args: list[Any]) -> GraphExecutable:
        actual = [*args, *lifted_constants]
        bindings = ShapeBindings.from_inputs(metas, actual)
        bindings.check(metas, actual)
        return build(bindings)

    names = [n.name for n in placeholders[:user_arg_count]]
    return ShapeSpecializer(name, build_for_call, names, options.max_shape_specializations, input_views(gm),
                            [*metas[:user_arg_count]])


def _bucketable(gm: torch.fx.GraphModule, metas: list[Any], targets: CompileTargets, options: Options,
                name: str) -> bool:
    """Whether ``gm`` compiles per bucket of sizes: not asked to compile per size, on one device of this
    process, and exact under padding. Else per-size executables, with one warning naming the op that is not
    exact where buckets were asked for, a log line where they are only the default."""
    if options.dynamic_mode == "exact":
        return False
    why = None
    if options.mesh is not None or len(targets.lowered_for.devices) != 1:
        why = "programs over a device mesh compile per size"
    elif not BucketedGraph.readable(metas):
        why = "a size symbol is not the size of any input, so a call cannot say it"
    else:
        found = padding_safety.first_inexact(gm, runtime_symbols(metas))
        why = found[1] if found is not None else None
    if why is not None and options.dynamic_mode == "bucket":
        warnings.warn(f"tpucompile compiles {name} once per size, not per bucket: {why}", TpuCompileWarning,
                      stacklevel=2)
    elif why is not None:
        log.info("compiling %s once per size, not per bucket: %s", name, why)
    return why is None
