"""Annotating each ATen graph AOTAutograd makes from a graph whose plan is bound (``sharding.binding``).

``annotate_shardings`` puts a ``shard_annotation`` after every tensor placeholder (the plan's dims, or
replicated), after each constrained submodule output, and before every output returned to the caller
(replicated, so results come back whole, unless the plan keeps it split; the new value of an input updated
in place keeps the input's layout, and under a fully sharded plan so does each gradient). The annotations are
ordinary graph nodes, so they are part of the graph's cache key and show in dumps; lowering turns them into
Shardy attributes and constraints.

AOTAutograd names the placeholders of its graphs after Dynamo's inputs: ``argN_1`` (inference) is input N,
``primals_N`` (forward, and the saved inputs of a backward) is input N-1. The values a forward saves for its
backward are left to XLA's propagation; ``record_layouts`` notes how the forward program returned each (by
the name AOTAutograd gave the output, which the backward's placeholder shares even where a pass replaced the
output node), and the backward expects them laid out the same way, so
they pass from one program to the other without being sent again. Under a plan that is fully sharded and
nothing else they are split along the first dimension the data axis divides instead, in both programs:
activations then take 1/N of each chip's memory whatever XLA would choose, and the programs do not depend on
another program's compile (a compile-only run and a run on the slice annotate them alike). Gradients of the
outputs are replicated.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from tpucompile.contracts.loop_ops import is_loop, loop_parts
from tpucompile.errors import TpuCompileWarning
from tpucompile.sharding.names import module_outputs
from tpucompile.sharding.plan import (
    Dims,
    Mesh,
    ShardPlan,
    decode_sharding,
    encode_sharding,
    format_dims,
    shard_annotation,
    spread_dims,
)


def annotate_shardings(gm: torch.fx.GraphModule, mesh: Mesh, plan: ShardPlan, processes: int = 1) -> None:
    """Annotate the tensor placeholders and outputs of the ATen graph ``gm`` (see the module doc);
    ``processes``: how many processes share the mesh."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return
    bound = plan.bound or ()
    backward = any(p.name.startswith("tangents_") for p in placeholders)
    spread = plan.spread_axis(mesh) if processes == 1 else None
    # Saved activations follow the plan only when it is fully sharded and nothing else: beside tensor
    # parallelism, XLA splits them over the model axis too, which a data-axis annotation would undo.
    spread_saved = spread if all(rule.spread is not None for rule in plan.rules) else None
    insert_after = placeholders[-1]
    for placeholder in placeholders:
        val = placeholder.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        if not backward and input_index(placeholder.name) is None:
            _warn_unnamed_input(placeholder.name, bound)
        dims = _placeholder_dims(placeholder.name, bound, val.dim())
        if backward and not _PRIMAL.fullmatch(placeholder.name):
            saved = plan.layouts.get(placeholder.name)
            dims = saved if saved is not None and len(saved) == val.dim() else dims
            if spread_saved is not None and not placeholder.name.startswith("tangents_"):
                dims = spread_dims(((),) * val.dim(), tuple(val.shape), spread_saved, mesh)
        with graph.inserting_after(insert_after):
            node = graph.call_function(shard_annotation, (placeholder, encode_sharding(mesh.axes, dims)))
        node.meta["val"] = val
        insert_after = node
        placeholder.replace_all_uses_with(node, delete_user_cb=lambda user, n=node: user is not n
                                          and user.op != "output")
    if not backward:
        _keep_stacked_parameters_split(graph, mesh)
    if plan.bound_activations and not backward:
        outputs_of = module_outputs(gm)
        for path, dims in plan.bound_activations:
            for value in outputs_of.get(path, []):
                if value.meta["val"].dim() != len(dims):
                    _warn_rank(f"the value {value.name} returned by submodule {path!r}", dims,
                               value.meta["val"].dim(), "left to XLA's propagation")
                    continue
                with graph.inserting_after(value):
                    node = graph.call_function(shard_annotation, (value, encode_sharding(mesh.axes, dims)))
                node.meta.update(value.meta)
                value.replace_all_uses_with(node, delete_user_cb=lambda user, n=node: user is not n)
    output = graph.output_node()
    results = output.args[0]
    single = not isinstance(results, (list, tuple))
    results = [results] if single else list(results)
    returned, first_user = (len(results), None) if backward else _output_roles(placeholders, len(results), processes)
    updated = () if backward else _updated_inputs()
    kept = plan.bound_outputs or ()
    wrapped: dict[torch.fx.Node, torch.fx.Node] = {}
    new_results = []
    dtensors: dict[int, tuple[str, int]] = {}
    for position, result in enumerate(results):
        if position >= returned and result not in wrapped:
            if spread_saved is not None and _computed_tensor(result):  # fully sharded: activations split too
                result = _annotated(graph, output, result, spread_dims(
                    ((),) * result.meta["val"].dim(), tuple(result.meta["val"].shape), spread_saved, mesh), mesh)
            new_results.append(result)  # otherwise saved for the backward laid out as XLA finds best
            continue
        # An output of the user's (or, from a backward, the gradient of input `position`) may have dims to keep
        # and come back as a DTensor.
        source = ("input", position) if backward else ("output", position - (first_user or 0))
        dims = None
        if backward and ("input", position) in plan.dtensors:
            dims = bound[position]
        elif backward and spread is not None and position < len(bound):
            dims = bound[position]  # fully sharded: the gradient is reduce-scattered, laid out as its parameter
        elif not backward and first_user is not None and 0 <= source[1] < len(kept):
            dims = kept[source[1]]
        elif not backward and processes == 1 and position < len(updated):
            dims = bound[updated[position]] if updated[position] < len(bound) else None  # an input's new value
        if backward and source in plan.dtensors and result is not None:
            dtensors[position] = source
        if (isinstance(result, torch.fx.Node) and result.op != "placeholder"
                and isinstance(result.meta.get("val"), torch.Tensor)):
            if result not in wrapped:
                rank = result.meta["val"].dim()
                if dims is not None and len(dims) != rank:
                    _warn_rank(f"output {position} ({result.name})", dims, rank, "returned whole")
                    dims = None
                dims = ((),) * rank if dims is None else dims
                wrapped[result] = _annotated(graph, output, result, dims, mesh)
            result = wrapped[result]
        new_results.append(result)
    output.args = (new_results[0] if single else type(output.args[0])(new_results),)
    gm.meta["dtensor_outputs"] = dtensors
    gm.recompile()


def _keep_stacked_parameters_split(graph: torch.fx.Graph, mesh: Mesh) -> None:
    """A rolled loop's stacked parameters laid out as the parameters they stack, with the layer dimension
    whole: each iteration then slices its layer's block where it lies and gathers only that layer (under
    FSDP). Left to XLA's propagation, the stack (a concatenation of the layers' weights) was split along
    the layer dimension and gathered whole before the loop: every layer's gathered weights at once (a
    405B-shaped plan asked for 438 GB of temporaries per chip)."""
    for node in list(graph.nodes):
        if not is_loop(node):
            continue
        for stacked in loop_parts(node)[2]:
            dims = _stacked_annotation_dims(stacked)
            if dims is None:
                continue
            with graph.inserting_after(stacked):
                annotation = graph.call_function(shard_annotation, (stacked, encode_sharding(mesh.axes, dims)))
            annotation.meta["val"] = stacked.meta["val"]
            node.replace_input_with(stacked, annotation)


def _stacked_annotation_dims(stacked: Any) -> Dims | None:
    """``((), *dims)`` for a stack of annotated values that share ``dims`` (``torch.stack`` as AOTAutograd's
    decompositions write it: a concatenation along dimension 0, viewed with the layer dimension in front, or
    a concatenation of values unsqueezed at 0); None for anything else."""
    if not isinstance(stacked, torch.fx.Node) or stacked.op != "call_function":
        return None
    aten = torch.ops.aten
    if stacked.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        concatenated, unsqueezed = stacked.args[0], False
    else:
        concatenated, unsqueezed = stacked, True
    if (not isinstance(concatenated, torch.fx.Node) or concatenated.target is not aten.cat.default
            or (len(concatenated.args) > 1 and concatenated.args[1] != 0)):
        return None
    layers = list(concatenated.args[0])
    if unsqueezed:
        if not all(isinstance(x, torch.fx.Node) and x.target is aten.unsqueeze.default and x.args[1] == 0
                   for x in layers):
            return None
        layers = [x.args[0] for x in layers]
    if not all(isinstance(x, torch.fx.Node) and x.target is shard_annotation for x in layers):
        return None
    found = {decode_sharding(x.args[1])[1] for x in layers}
    shape = tuple(stacked.meta["val"].shape)
    if len(found) != 1 or shape[1:] != tuple(layers[0].meta["val"].shape) or shape[0] != len(layers):
        return None
    return ((), *found.pop())


def _computed_tensor(value: Any) -> bool:
    return (isinstance(value, torch.fx.Node) and value.op != "placeholder" and value.target is not shard_annotation
            and isinstance(value.meta.get("val"), torch.Tensor))


def _annotated(graph: torch.fx.Graph, output: torch.fx.Node, value: torch.fx.Node, dims: Dims,
               mesh: Mesh) -> torch.fx.Node:
    """``value`` laid out as ``dims``: an annotation node just before the graph's output."""
    with graph.inserting_before(output):
        node = graph.call_function(shard_annotation, (value, encode_sharding(mesh.axes, dims)))
    node.meta["val"] = value.meta["val"]
    return node


def _output_roles(placeholders: Sequence[torch.fx.Node], count: int, processes: int) -> tuple[int, int | None]:
    """For an inference or forward graph: how many outputs are returned to the caller (the others are saved
    for the backward), and the position of the first of the user's outputs (after the updated values of
    mutated inputs), from AOTAutograd's metadata; None when it is not known.

    Values saved for the backward can stay split over the devices, unless several processes share the mesh
    (a result must then come back whole in every process)."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    first_user = getattr(metadata, "num_mutated_inp_runtime_indices", None)
    if not any(p.name.startswith("primals_") for p in placeholders) or processes > 1:
        return count, first_user
    returns = getattr(metadata, "num_forward_returns", None)
    return (count if returns is None else returns), first_user


def _updated_inputs() -> tuple[int, ...]:
    """For an inference or forward graph: the input each of its first outputs is the new value of (AOTAutograd
    returns the updated values of inputs mutated in place first, in this order)."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    return tuple(getattr(metadata, "mutated_inp_runtime_indices", None) or ())


OUTPUT_NAMES_KEY = "tpucompile_output_names"
"""Graph meta: the names of the graph's outputs as AOTAutograd made them, before passes replaced any (a no-op
view returned for the backward becomes its base, while the backward's placeholder keeps the view's name)."""


def remember_output_names(gm: torch.fx.GraphModule) -> None:
    """Note ``gm``'s output names as they are now (``OUTPUT_NAMES_KEY``), once, before any pass runs."""
    if OUTPUT_NAMES_KEY in gm.meta:
        return
    results = gm.graph.output_node().args[0]
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    gm.meta[OUTPUT_NAMES_KEY] = [r.name if isinstance(r, torch.fx.Node) else None for r in results]


def record_layouts(gm: torch.fx.GraphModule, output_plan: Sequence[Any], result_dims: Sequence[Dims | None],
                   plan: ShardPlan) -> None:
    """Note how the program of the annotated graph ``gm`` returns each output (by the name AOTAutograd gave it,
    which the backward's placeholder for it shares), for the backward graph that takes some of them."""
    results = gm.graph.output_node().args[0]
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    names = gm.meta.get(OUTPUT_NAMES_KEY) or [None] * len(results)
    for result, slot, name in zip(results, output_plan, names, strict=False):
        if not isinstance(result, torch.fx.Node) or slot.kind != "result" or slot.part is not None:
            continue
        if result.target is shard_annotation:
            result = result.args[0]
        plan.layouts[name or result.name] = result_dims[slot.index]


_PRIMAL = re.compile(r"primals_(\d+)")


_ARG = re.compile(r"arg(\d+)_1")


def input_index(name: str) -> int | None:
    """Which of AOTAutograd's inputs (in its order) the placeholder ``name`` is: ``primals_N`` is N-1, ``argN_1``
    is N; None for other placeholders (a backward's saved values and tangents)."""
    if match := _PRIMAL.fullmatch(name):
        return int(match[1]) - 1
    if match := _ARG.fullmatch(name):
        return int(match[1])
    return None


def _placeholder_dims(name: str, bound: Sequence[Dims | None], rank: int) -> Dims:
    index = input_index(name)
    dims = bound[index] if index is not None and 0 <= index < len(bound) else None
    if dims is not None and len(dims) != rank:
        _warn_rank(f"graph input {name}", dims, rank, "replicated")
        dims = None
    return ((),) * rank if dims is None else dims


def _warn_unnamed_input(name: str, bound: Sequence[Dims | None]) -> None:
    """An input of a forward or inference graph that the plan cannot match to an input of the model (its
    name is not one AOTAutograd gives them) is replicated; say so when the plan splits any input, since that
    input may be one of them. Constants lifted to inputs (``lifted_*``) are replicated by design."""
    if name.startswith("lifted_") or not any(dims and any(dims) for dims in bound):
        return
    warnings.warn(f"tpucompile: graph input {name!r} is not named primals_N or argN_1, so the sharding plan "
                  "cannot tell which model input it is; it is replicated on every device", TpuCompileWarning,
                  stacklevel=3)


def _warn_rank(what: str, dims: Dims, rank: int, outcome: str) -> None:
    """A layout that names another number of dimensions than the value it is for has is not applied."""
    warnings.warn(f"tpucompile: the sharding plan lays {what} out as {format_dims(dims)} ({len(dims)} "
                  f"dimensions), but it has {rank}; the constraint is skipped and it is {outcome}",
                  TpuCompileWarning, stacklevel=3)

