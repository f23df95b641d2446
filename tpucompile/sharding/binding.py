"""Binding a sharding plan to one Dynamo graph, before anything is traced or compiled.

``bind_sharding`` names every graph input, output and (when the plan asks) submodule output
(``sharding.names``), resolves the plan against those names and the mesh, and checks the mesh against the
devices present: every mistake in a plan is reported here. ``DTensor`` inputs bring their own mesh and
placements, which are read as the plan; the graph is then traced with plain tensors of their global shape, and
``dtensor_outputs`` gives back as ``DTensor``s the outputs that are ``DTensor``s eagerly.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from tpucompile.config import Options
from tpucompile.errors import ShardingError
from tpucompile.runtime import get_mesh_target, initialize_distributed, process_devices
from tpucompile.runtime.targets.compile_only import compile_targets, spanning
from tpucompile.sharding.names import graph_activations, graph_inputs, graph_outputs
from tpucompile.sharding.plan import Dims, Mesh, ShardPlan


def bind_sharding(
    options: Options, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> tuple[Options, list[Any]]:
    """``options`` with the plan resolved for ``gm``'s inputs, and the example inputs AOTAutograd should trace
    with (``DTensor``s become plain tensors of their global shape); both unchanged without a mesh."""
    dtensors = {i: e for i, e in enumerate(example_inputs) if _is_dtensor(e)}
    if options.mesh is None and options.shard is None and not dtensors:
        return options, list(example_inputs)
    if dtensors:
        options = _dtensor_options(options, dtensors)
    mesh = options.mesh or options.shard.mesh
    if mesh is None:
        raise ShardingError("the 'shard' option needs a mesh: pass options={'mesh': tpucompile.Mesh(...)} or "
                            "build the plan with data_parallel(mesh)/tensor_parallel(mesh, ...)")
    plan = options.shard or ShardPlan()
    if plan.mesh is not None and plan.mesh != mesh:
        raise ShardingError(f"the sharding plan was made for {plan.mesh!r}, the 'mesh' option is {mesh!r}")
    if options.compile_only:  # the mesh is the slice's, not this machine's
        for target in compile_targets(options.targets, options.platform):
            spanning(target, mesh.size)  # a mesh larger than the slice fails here
    else:
        initialize_distributed(options.coordinator, options.num_processes, options.process_id)
        get_mesh_target(options.platform, mesh.size, mesh.devices)  # a mesh larger than the devices fails here
    inputs = graph_inputs(gm, example_inputs)  # the attributes AOTAutograd lifts come first
    lifted = len(inputs) - len(example_inputs)
    outputs = graph_outputs(gm)
    described = {}  # DTensors say how they are laid out themselves: the plan must not say it again
    for index, example in ((lifted + i, e) for i, e in dtensors.items()):
        for rule in plan.rules:
            if not rule.optional and rule.applies_to != "output" and fnmatch.fnmatchcase(inputs[index].name,
                                                                                          rule.pattern):
                raise ShardingError(f"{inputs[index].name!r} is a DTensor, whose placements already lay it out; "
                                    f"drop the sharding plan entry {rule.pattern!r}")
        described[("input", index)] = (example.device_mesh, tuple(example.placements))
        inputs[index] = dataclasses.replace(inputs[index], shape=None)
    for index, example in enumerate(_output_examples(gm)):
        if _is_dtensor(example):  # comes back whole, as a replicated DTensor
            described[("output", index)] = (example.device_mesh, tuple(example.placements))
            outputs[index] = dataclasses.replace(outputs[index], shape=None)
    activations = graph_activations(gm) if any(r.applies_to == "activation" for r in plan.rules) else []
    dims = list(plan.resolve([*inputs, *outputs, *activations], mesh))
    for index, example in dtensors.items():
        dims[lifted + index] = _placement_dims(example.placements, example.dim(), mesh, index)
    constrained = {value.name.removesuffix(":output"): d
                   for value, d in zip(activations, dims[len(inputs) + len(outputs):], strict=True) if d is not None}
    dims = dims[:len(inputs) + len(outputs)]
    bound, kept = tuple(dims[:len(inputs)]), tuple(dims[len(inputs):])
    if options.num_processes > 1 and any(d is not None for d in kept):
        raise ShardingError("outputs come back whole when several processes share the mesh; drop the plan's "
                            "'output:' entries")
    bound_plan = dataclasses.replace(plan, mesh=mesh, bound=bound, bound_outputs=kept,
                                     bound_activations=tuple(sorted(constrained.items())), dtensors=described,
                                     layouts={})
    plain = [_global_placeholder(e) if _is_dtensor(e) else e for e in example_inputs]
    return dataclasses.replace(options, mesh=mesh, shard=bound_plan), plain


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "placements")


def _dtensor_options(options: Options, dtensors: dict[int, Any]) -> Options:
    """The mesh (and process group) that ``DTensor`` inputs live on, as options: torch rank r runs on the
    first device of jax process r."""
    device_mesh = next(iter(dtensors.values())).device_mesh
    if any(d.device_mesh != device_mesh for d in dtensors.values()):
        raise ShardingError("the graph's DTensors live on different device meshes; tpucompile runs one mesh")
    names = device_mesh.mesh_dim_names
    if names is None:
        raise ShardingError("name the dimensions of the DTensors' device mesh (init_device_mesh(..., "
                            "mesh_dim_names=(...)))")
    world = torch.distributed.get_world_size()
    if options.num_processes not in (1, world):
        raise ShardingError(f"the DTensors' process group has {world} processes, options say "
                            f"num_processes={options.num_processes}")
    process_id = torch.distributed.get_rank() if options.process_id is None else options.process_id
    options = dataclasses.replace(options, num_processes=world, process_id=process_id)
    initialize_distributed(options.coordinator, options.num_processes, options.process_id)
    first_devices = process_devices(options.platform)
    ranks = [int(r) for r in device_mesh.mesh.flatten().tolist()]
    mesh = Mesh(tuple(zip(names, device_mesh.mesh.shape, strict=True)), devices=[first_devices[r] for r in ranks])
    if options.mesh is not None and (options.mesh.axes != mesh.axes):
        raise ShardingError(f"the DTensors live on {mesh!r}, the 'mesh' option is {options.mesh!r}")
    return dataclasses.replace(options, mesh=mesh)


def _placement_dims(placements: Sequence[Any], rank: int, mesh: Mesh, index: int) -> Dims:
    """The dims of a ``DTensor``'s placements: ``Shard(d)`` on mesh dimension i splits d over axis i."""
    dims: list[tuple[str, ...]] = [() for _ in range(rank)]
    for axis, placement in zip(mesh.axis_names, placements, strict=True):
        if placement.is_shard():
            dims[placement.dim % rank] += (axis,)
        elif placement.is_partial():
            raise ShardingError(f"DTensor input {index} has a Partial placement on mesh axis {axis!r}; "
                                "redistribute it to Replicate or Shard first")
        elif not placement.is_replicate():
            raise ShardingError(f"DTensor input {index}: placement {placement} is not supported")
    return tuple(dims)


def dtensor_outputs(options: Options, compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, returning as ``DTensor``s the outputs that are ``DTensor``s when the graph runs eagerly
    (replicated: their values come back whole); ``compiled`` itself when there are none."""
    plan = options.shard
    wrapped = {i: spec for (kind, i), spec in (plan.dtensors.items() if plan is not None else ()) if kind == "output"}
    if not wrapped:
        return compiled
    from torch.distributed.tensor import DTensor, Replicate

    def convert(outputs: Any) -> Any:
        converted = list(outputs)
        for index, (device_mesh, placements) in wrapped.items():
            value = converted[index]
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                converted[index] = DTensor.from_local(value, device_mesh, [Replicate()] * len(placements),
                                                      run_check=False)
        return type(outputs)(converted) if isinstance(outputs, tuple) else converted

    def run(*args: Any) -> Any:
        return convert(compiled(*args))

    return run


def _output_examples(gm: torch.fx.GraphModule) -> list[Any]:
    results = gm.graph.output_node().args[0]
    return [r.meta.get("example_value") if isinstance(r, torch.fx.Node) else None
            for r in (results if isinstance(results, (list, tuple)) else [results])]


def _global_placeholder(dtensor: Any) -> torch.Tensor:
    """A plain tensor standing for a ``DTensor`` while AOTAutograd traces: its global shape and dtype."""
    tensor = torch.empty(tuple(dtensor.shape), dtype=dtensor.dtype)
    if isinstance(dtensor, torch.nn.Parameter):
        return torch.nn.Parameter(tensor, requires_grad=dtensor.requires_grad)
    return tensor.requires_grad_(dtensor.requires_grad)

