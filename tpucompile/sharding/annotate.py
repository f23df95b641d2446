"""The sharding passes: bind a plan to a Dynamo graph's inputs, then annotate each ATen graph made from it.

``bind_sharding`` runs once per Dynamo graph, before anything is traced or compiled: it names every graph
input (parameters and buffers by their path in the module, recovered from Dynamo's source of each
placeholder; arguments by their name in the forward), every output (``output:N``) and, when the plan asks,
what each submodule returns (``path:output``, from the modules Dynamo recorded on each node); it resolves the
plan against those names and the mesh, and checks the mesh against the devices present. Every mistake in a
plan is reported here. ``DTensor`` inputs bring their own mesh and placements, which are read as the plan; the
graph is then traced with plain tensors of their global shape.

``annotate_shardings`` runs on each ATen graph AOTAutograd makes. It puts a ``shard_annotation`` after every
tensor placeholder (the plan's dims, or replicated), after each constrained submodule output, and before
every output returned to the caller (replicated, so results come back whole, unless the plan keeps it split).
The annotations are ordinary graph nodes, so they are part of the graph's cache key and show in dumps;
lowering turns them into Shardy attributes and constraints.

AOTAutograd names the placeholders of its graphs after Dynamo's inputs: ``argN_1`` (inference) is input N,
``primals_N`` (forward, and the saved inputs of a backward) is input N-1. The values a forward saves for its
backward are left to XLA's propagation; ``record_layouts`` notes how the forward program returned each (by
node name, which the backward's placeholders share), and the backward expects them laid out the same way, so
they pass from one program to the other without being sent again. Gradients of the outputs are replicated.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from tpucompile.config import Options
from tpucompile.errors import ShardingError
from tpucompile.runtime import get_mesh_target, initialize_distributed, process_count, process_devices
from tpucompile.sharding import Dims, GraphValue, Mesh, ShardPlan, encode_sharding, shard_annotation


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
    initialize_distributed(options.coordinator, options.num_processes, options.process_id)
    get_mesh_target(options.platform, mesh.size, mesh.devices)  # a mesh larger than the devices fails here
    inputs = graph_inputs(gm, example_inputs)
    outputs = graph_outputs(gm)
    described = {}  # DTensors say how they are laid out themselves: the plan must not say it again
    for index, example in dtensors.items():
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
        dims[index] = _placement_dims(example.placements, example.dim(), mesh, index)
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


def graph_outputs(gm: torch.fx.GraphModule) -> list[GraphValue]:
    """The outputs of a Dynamo graph, named ``output:N`` (what a plan names to keep an output split)."""
    results = gm.graph.output_node().args[0]
    found = []
    for index, result in enumerate(results if isinstance(results, (list, tuple)) else [results]):
        example = result.meta.get("example_value") if isinstance(result, torch.fx.Node) else None
        shape = tuple(int(s) for s in example.shape) if isinstance(example, torch.Tensor) else None
        dtype = str(example.dtype).removeprefix("torch.") if shape is not None else ""
        found.append(GraphValue(f"output:{index}", shape, dtype=dtype, is_output=True))
    return found


def graph_activations(gm: torch.fx.GraphModule) -> list[GraphValue]:
    """The values submodules return, named ``path:output`` (what a plan names to constrain them)."""
    found = []
    for path, nodes in module_outputs(gm).items():
        for node in nodes:
            example = node.meta.get("example_value", node.meta.get("val"))
            shape = tuple(int(s) for s in example.shape)
            found.append(GraphValue(f"{path}:output", shape, dtype=str(example.dtype).removeprefix("torch."),
                                    is_activation=True))
    return found


_MODULE_ROOT = re.compile(r"""^[LG]\[['"][^'"]+['"]\]\.?""")


def module_outputs(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """For each submodule (by path in the compiled module), the tensor nodes it computes that are used outside
    it: what it returns. Dynamo records the modules each node was traced in (``nn_module_stack``), and
    AOTAutograd keeps the record on the forward's ATen nodes."""

    def scopes(node: torch.fx.Node) -> set[str]:
        stack = node.meta.get("nn_module_stack") or {}
        return {_MODULE_ROOT.sub("", str(value[0])) for value in stack.values()}

    found: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val"))
        if node.op != "call_function" or not isinstance(value, torch.Tensor):
            continue
        inside = scopes(node)
        for path in sorted(inside):
            if path and any(user.op == "output" or path not in scopes(user) for user in node.users):
                found.setdefault(path, []).append(node)
    return found


def graph_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[GraphValue]:
    """What a plan is matched against: each input of a Dynamo graph, named by where Dynamo found it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = []
    for index, example in enumerate(example_inputs):
        node = placeholders[index] if index < len(placeholders) else None
        source = _source_name(node)
        name = input_name(source) if source else (node.name if node is not None else f"input{index}")
        if not isinstance(example, torch.Tensor):
            found.append(GraphValue(name, None))
            continue
        is_state = isinstance(example, torch.nn.Parameter) or bool(
            source and re.search(r"\._(parameters|buffers)\[", source)
        )
        shape = tuple(int(s) for s in example.shape)
        found.append(GraphValue(name, shape, is_state, str(example.dtype).removeprefix("torch.")))
    return found


def _source_name(node: torch.fx.Node | None) -> str | None:
    if node is None:
        return None
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None) or getattr(node, "_dynamo_source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else str(name)


_ROOT = re.compile(r"""^[LG]\[['"](?P<name>[^'"]+)['"]\]""")
_STEP = re.compile(
    r"""\._(?P<kind>modules|parameters|buffers)\[['"](?P<member>[^'"]+)['"]\]"""
    r"""|\.(?P<attr>[A-Za-z_]\w*)"""
    r"""|\[['"](?P<key>[^'"]+)['"]\]"""
    r"""|\[(?P<index>-?\d+)\]"""
)


def input_name(source: str) -> str:
    """``L['self']._modules['blocks']._modules['0']._parameters['weight']`` → ``blocks.0.weight`` (the path in
    the compiled module, whatever Dynamo's frame called it); ``L['idx']`` → ``idx``. A source of another form
    is returned as is."""
    root = _ROOT.match(source)
    if root is None:
        return source
    parts = [root["name"]]
    position = root.end()
    in_module = False
    while position < len(source):
        step = _STEP.match(source, position)
        if step is None:
            return source
        if step["kind"] and len(parts) == 1:
            in_module = True
        parts.append(next(v for k, v in step.groupdict().items() if v is not None and k != "kind"))
        position = step.end()
    return ".".join(parts[1:] if in_module else parts)


def annotate_shardings(gm: torch.fx.GraphModule, mesh: Mesh, plan: ShardPlan) -> None:
    """Annotate the tensor placeholders and outputs of the ATen graph ``gm`` (see the module doc)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return
    bound = plan.bound or ()
    backward = any(p.name.startswith("tangents_") for p in placeholders)
    insert_after = placeholders[-1]
    for placeholder in placeholders:
        val = placeholder.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        dims = _placeholder_dims(placeholder.name, bound, val.dim())
        if backward and not _PRIMAL.fullmatch(placeholder.name):
            saved = plan.layouts.get(placeholder.name)
            dims = saved if saved is not None and len(saved) == val.dim() else dims
        with graph.inserting_after(insert_after):
            node = graph.call_function(shard_annotation, (placeholder, encode_sharding(mesh.axes, dims)))
        node.meta["val"] = val
        insert_after = node
        placeholder.replace_all_uses_with(node, delete_user_cb=lambda user, n=node: user is not n
                                          and user.op != "output")
    if plan.bound_activations and not backward:
        outputs_of = module_outputs(gm)
        for path, dims in plan.bound_activations:
            for value in outputs_of.get(path, []):
                if value.meta["val"].dim() != len(dims):
                    continue
                with graph.inserting_after(value):
                    node = graph.call_function(shard_annotation, (value, encode_sharding(mesh.axes, dims)))
                node.meta.update(value.meta)
                value.replace_all_uses_with(node, delete_user_cb=lambda user, n=node: user is not n)
    output = graph.output_node()
    results = output.args[0]
    single = not isinstance(results, (list, tuple))
    results = [results] if single else list(results)
    returned, first_user = (len(results), None) if backward else _output_roles(placeholders, len(results))
    kept = plan.bound_outputs or ()
    wrapped: dict[torch.fx.Node, torch.fx.Node] = {}
    new_results = []
    dtensors: dict[int, tuple[str, int]] = {}
    for position, result in enumerate(results):
        if position >= returned and result not in wrapped:
            new_results.append(result)  # saved for the backward: laid out as XLA finds best
            continue
        # An output of the user's (or, from a backward, the gradient of input `position`) may have dims to keep
        # and come back as a DTensor.
        source = ("input", position) if backward else ("output", position - (first_user or 0))
        dims = None
        if backward and ("input", position) in plan.dtensors:
            dims = bound[position]
        elif not backward and first_user is not None and 0 <= source[1] < len(kept):
            dims = kept[source[1]]
        if backward and source in plan.dtensors and result is not None:
            dtensors[position] = source
        if (isinstance(result, torch.fx.Node) and result.op != "placeholder"
                and isinstance(result.meta.get("val"), torch.Tensor)):
            if result not in wrapped:
                rank = result.meta["val"].dim()
                dims = dims if dims is not None and len(dims) == rank else ((),) * rank
                with graph.inserting_before(output):
                    node = graph.call_function(shard_annotation, (result, encode_sharding(mesh.axes, dims)))
                node.meta["val"] = result.meta["val"]
                wrapped[result] = node
            result = wrapped[result]
        new_results.append(result)
    output.args = (new_results[0] if single else type(output.args[0])(new_results),)
    gm.meta["dtensor_outputs"] = dtensors
    gm.recompile()


def _output_roles(placeholders: Sequence[torch.fx.Node], count: int) -> tuple[int, int | None]:
    """For an inference or forward graph: how many outputs are returned to the caller (the others are saved
    for the backward), and the position of the first of the user's outputs (after the updated values of
    mutated inputs), from AOTAutograd's metadata; None when it is not known.

    Values saved for the backward can stay split over the devices, unless several processes share the mesh
    (a result must then come back whole in every process)."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    first_user = getattr(metadata, "num_mutated_inp_runtime_indices", None)
    if not any(p.name.startswith("primals_") for p in placeholders) or process_count() > 1:
        return count, first_user
    returns = getattr(metadata, "num_forward_returns", None)
    return (count if returns is None else returns), first_user


def record_layouts(gm: torch.fx.GraphModule, output_plan: Sequence[Any], result_dims: Sequence[Dims | None],
                   plan: ShardPlan) -> None:
    """Note how the program of the annotated graph ``gm`` returns each output (by node name), for the
    backward graph that takes some of them."""
    results = gm.graph.output_node().args[0]
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    for result, slot in zip(results, output_plan, strict=False):
        if not isinstance(result, torch.fx.Node) or slot.kind != "result":
            continue
        if result.target is shard_annotation:
            result = result.args[0]
        plan.layouts[result.name] = result_dims[slot.index]


_PRIMAL = re.compile(r"primals_(\d+)")
_ARG = re.compile(r"arg(\d+)_1")


def _placeholder_dims(name: str, bound: Sequence[Dims | None], rank: int) -> Dims:
    index = None
    if match := _PRIMAL.fullmatch(name):
        index = int(match[1]) - 1
    elif match := _ARG.fullmatch(name):
        index = int(match[1])
    dims = bound[index] if index is not None and 0 <= index < len(bound) else None
    if dims is None or len(dims) != rank:
        return ((),) * rank
    return dims
