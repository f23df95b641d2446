"""The ``tpucompile`` backend for ``torch.compile``.

Dynamo hands us an FX graph of torch-level ops. AOTAutograd functionalises it and, with our decomposition
table, turns it into ATen graphs: one for inference, or a forward and a backward for training. Each ATen graph
is compiled by ``driver.compile_graph``. Input mutations (BatchNorm running stats, in-place updates of
buffers) are returned by the functional graph and written back by AOTAutograd's runtime wrapper. On a warm
start, a graph whose plan is cached skips AOTAutograd altogether (``plan_replay``); on a cold one, such a graph
runs through AOTAutograd's wrapper only until its plan is complete, then through the plan's runner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd

from tpucompile import plan_replay
from tpucompile.config import Options, narrow_products_for, roll_layers_for
from tpucompile.contracts.saved_handoff import SAVED_HANDOFF, HandoffEnd, SavedHandoff
from tpucompile.debug import recorder as dump
from tpucompile.driver import compile_graph, decompositions_for, record_graph, resolve_targets
from tpucompile.driver.host_kernel_upgrades import compiling
from tpucompile.errors import OptionsError, TpuCompileWarning
from tpucompile.frontend import (
    FIRST_TRIAL,
    USES_KEY,
    LoopBodyTrial,
    fit_loop_bodies,
    fitting_partition,
    graph_input_uses,
    mark_donatable,
    rewrite_attention,
    rewrite_interpolation,
    roll_repeated_layers,
    take_out_parameter_stacks,
    traced_budget,
    traced_like_real_tensors,
)
from tpucompile.sharding.binding import bind_sharding, dtensor_outputs

_graph_counter = itertools.count()


def tpucompile_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[torch.Tensor],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """Entry point Dynamo calls for ``torch.compile(model, backend="tpucompile", options=...)``."""
    config, example_inputs = bind_sharding(_compile_only_when_meta(Options.from_sources(options), gm, example_inputs),
                                           gm, example_inputs)
    targets = resolve_targets(config)
    index = next(_graph_counter)
    dump.start_from_environment()
    record_graph(f"graph {index}", "fx", gm)
    if rewrite_attention(gm, kernel=targets.attention_kernel, prescale_query=config.prescale_attention_query,
                         group_queries=config.grouped_query_attention):
        record_graph(f"graph {index}", "fx_rewrite_attention", gm)
    if rewrite_interpolation(gm):
        record_graph(f"graph {index}", "fx_rewrite_interpolation", gm)
    rolling = None
    if roll_layers_for(config.roll_layers, targets.platforms, config.mesh):
        rolling = roll_repeated_layers(gm)
        if rolling.notes:
            record_graph(f"graph {index}", "fx_roll_layers", gm)
    if rolling is None or rolling.unrolled is None:
        return _compile_graph(gm, example_inputs, config, targets, index)
    stacked = take_out_parameter_stacks(gm, example_inputs, f"graph {index}") \
        if config.stacked_parameters and config.mesh is None else None
    try:
        if stacked is None:
            return _compile_graph(gm, example_inputs, config, targets, index)
        inner, stacks = stacked
        record_graph(f"graph {index}", "fx_stacked_parameters", inner)
        return stacks.wrap(_compile_graph(inner, stacks.inner_examples(example_inputs), config, targets, index))
    except Exception as error:  # e.g. PyTorch cannot differentiate the loop: the layers as Dynamo traced them
        compiled = _compile_graph(rolling.unrolled, example_inputs, config, targets, index)
        warnings.warn(f"tpucompile compiled graph {index} with its layers unrolled: rolled into a loop it failed "
                      f"({type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]})",
                      TpuCompileWarning, stacklevel=2)
        return compiled


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Options, targets: Any,
                   index: int) -> Callable[..., Any]:
    """AOTAutograd's forward and backward (or inference) of the rewritten Dynamo graph ``gm``, each compiled
    by ``driver.compile_graph``, or the cached plan's runner in their place."""
    recorder = None
    with _aot_autograd_settings(config):  # the plan is keyed on the settings AOTAutograd will trace with
        components = None if config.compile_only else plan_replay.plan_components(gm, example_inputs, config, targets)
    if components is not None and not dump.active():
        compiled = plan_replay.compiled_from_plan(components, config, f"graph {index}", targets)
        if compiled is not None:
            return compiled
        recorder = plan_replay.PlanRecorder(components, targets.tiers, len(example_inputs))
    elif not dump.active() and plan_replay.runs_direct(gm, example_inputs, config):
        recorder = plan_replay.PlanRecorder(None, targets.tiers, len(example_inputs))

    uses = graph_input_uses(gm, example_inputs)
    handoff = SavedHandoff()

    def compiler(role: str) -> Callable[[torch.fx.GraphModule, list[Any]], Callable]:
        def compile_role(aten_gm: torch.fx.GraphModule, aten_inputs: list[Any]) -> Callable:
            aten_gm.meta[USES_KEY] = uses  # step reports count memory by use
            if role == "forward":
                handoff.returns = _forward_returns()
            aten_gm.meta[SAVED_HANDOFF] = HandoffEnd(role, handoff)
            if config.donate:  # the plan's runner keeps the saved values as its own buffers
                mark_donatable(aten_gm, role, saved_on_device=recorder is not None and not recorder.abandoned)
            role_config = dataclasses.replace(
                config, narrow_products=narrow_products_for(config.narrow_products, role))
            compiled = compile_graph(aten_gm, aten_inputs, role_config, f"graph {index} ({role})", targets)
            if recorder is not None:
                recorder.record(role, aten_gm, compiled)
            return compiled

        return compile_role

    def trace(trial: LoopBodyTrial) -> Callable[..., Any]:
        with _aot_autograd_settings(config, trial), traced_like_real_tensors(example_inputs), compiling():
            return dtensor_outputs(config, aot_autograd(
                fw_compiler=compiler("forward"),
                bw_compiler=compiler("backward"),
                inference_compiler=compiler("inference"),
                decompositions=decompositions_for(targets, config),
                partition_fn=fitting_partition(config, trial),
            )(gm, example_inputs))

    compiled = fit_loop_bodies(trace)
    return compiled if recorder is None else recorder.take_over(compiled)


def _forward_returns() -> int | None:
    """For the forward graph being compiled: how many of its outputs AOTAutograd returns to the caller (the
    rest are saved for the backward); None when its metadata is not at hand."""
    context = torch._guards.TracingContext.try_get()
    return getattr(getattr(context, "fw_metadata", None), "num_forward_returns", None)


def _aot_autograd_settings(config: Options, trial: LoopBodyTrial = FIRST_TRIAL) -> contextlib.AbstractContextManager:
    """The functorch settings tpucompile traces with. Effect tokens (e.g. the error checks around linalg ops)
    stay inside the graphs instead of becoming runtime inputs that AOTAutograd passes as None. The activation
    budget is this compile's, not the process's (the option is in the plan key): the one rolled layers' loop
    bodies are partitioned at while the trace runs (``traced_budget``; at "auto", ``trial``'s); the partition
    of the whole graph picks its own. With ``recompute_product_operands``, the partition may recompute values
    that products read."""
    return torch._functorch.config.patch(unlift_effect_tokens=True,
                                         activation_memory_budget=traced_budget(config, trial),
                                         ban_recompute_materialized_backward=not config.recompute_product_operands)


def _compile_only_when_meta(config: Options, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Options:
    """``config``, compile-only when the graph's inputs are ``meta`` tensors and there are targets to compile
    for (the only thing meta tensors can do); a clear error when there are none, or when nothing would be
    compiled at all."""
    meta = next((i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and t.is_meta), None)
    if config.compile_only or meta is not None:
        if not config.targets:
            why = (f"input {_input_name(gm, meta)} is a meta tensor, which holds no values to run on"
                   if meta is not None and not config.compile_only else "compile_only compiles for targets only")
            raise OptionsError(f"{why}: give compile-only targets (options={{'targets': ['tpu:v5e:1x1']}} or "
                               "TPUCOMPILE_TARGETS), or real tensors to run")
        if not config.compile_only:
            config = dataclasses.replace(config, compile_only=True)
    return config


def _input_name(gm: torch.fx.GraphModule, index: int) -> str:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return repr(names[index]) if index < len(names) else str(index)
