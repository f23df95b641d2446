"""The names a sharding plan uses for a Dynamo graph's values: parameters and buffers by their path in the
module (recovered from Dynamo's source of each placeholder), arguments by their name in the forward, outputs as
``output:N``, and what a submodule returns as ``path:output``."""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from tpucompile.diagnostics import submodule_path
from tpucompile.sharding.plan import GraphValue


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


def module_outputs(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """For each submodule (by path in the compiled module), the tensor nodes it computes that are used outside
    it: what it returns. Dynamo records the modules each node was traced in (``nn_module_stack``), and
    AOTAutograd keeps the record on the forward's ATen nodes."""

    def scopes(node: torch.fx.Node) -> set[str]:
        stack = node.meta.get("nn_module_stack") or {}
        return {submodule_path(str(value[0])) for value in stack.values()}

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
    """What a plan is matched against: each input of the ATen graphs AOTAutograd makes from a Dynamo graph, in
    their order: first the tensors the graph holds as attributes (an optimiser step's parameters and state),
    which AOTAutograd lifts to inputs, then the graph's own inputs, named by where Dynamo found them.

    A parameter is named by its path in the module it was compiled with, in whatever graph it shows up (an
    optimiser step's too); so are its gradient and, where the graph says which parameter it belongs to, its
    optimiser state, so that one plan lays all of them out alike."""
    lifted = lifted_attributes(gm)
    parameters = [tensor for _, tensor in lifted if isinstance(tensor, torch.nn.Parameter)]
    found = [_state_value(name, tensor, parameters) for name, tensor in lifted]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gradients = _known_gradients()
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
        if is_state and name == input_name(source or ""):
            _remember(example, name)
        gradient_of = gradients.get(id(example))
        if gradient_of is not None:  # laid out as its parameter: the rules for parameters apply to it too
            name, is_state = gradient_of, True
        shape = tuple(int(s) for s in example.shape)
        found.append(GraphValue(name, shape, is_state, str(example.dtype).removeprefix("torch.")))
    return found


def lifted_attributes(gm: torch.fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``gm`` holds as attributes, in the order AOTAutograd passes them before the graph's inputs
    (parameters, then buffers, duplicates kept)."""
    return [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]


_known: dict[int, tuple[weakref.ref, str]] = {}
"""id(parameter) → (weak reference, its path in the module it was compiled with)."""


def _remember(tensor: torch.Tensor, name: str) -> None:
    if len(_known) > 4096:  # drop the entries of parameters that no longer exist
        for key in [k for k, (ref, _) in _known.items() if ref() is None]:
            del _known[key]
    _known[id(tensor)] = (weakref.ref(tensor), name)


def _known_name(tensor: torch.Tensor) -> str | None:
    entry = _known.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else None


def _known_gradients() -> dict[int, str]:
    """id(gradient) → the name of the known parameter whose ``.grad`` it is."""
    found = {}
    for ref, name in list(_known.values()):
        parameter = ref()
        if parameter is not None and parameter.grad is not None:
            found[id(parameter.grad)] = name
    return found


_STATE_INDEX = re.compile(r"state___(\d+)_")


def _state_value(attribute: str, tensor: torch.Tensor, parameters: Sequence[torch.Tensor]) -> GraphValue:
    """A lifted attribute: a known parameter by its module path; an optimiser's state (Dynamo names it after
    its position in the optimiser's state, which follows the parameters') by its parameter's path when the
    shapes agree; anything else by the attribute's name."""
    name = _known_name(tensor)
    if name is None and (match := _STATE_INDEX.search(attribute)):
        index = int(match[1])
        if index < len(parameters) and parameters[index].shape == tensor.shape:
            name = _known_name(parameters[index])
    shape = tuple(int(s) for s in tensor.shape)
    return GraphValue(name or attribute, shape, True, str(tensor.dtype).removeprefix("torch."))


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
    the compiled module, whatever Dynamo's frame called it); ``L['idx']`` → ``idx``. A forward wrapped by a
    decorator that takes ``*args, **kwargs`` (Hugging Face's models) is traced from the wrapper's frame: the module
    is ``L['args'][0]`` and keyword inputs are ``L['kwargs'][name]``, named as the unwrapped forward's would be
    (``model.layers.0.self_attn.q_proj.weight``, ``input_ids``). A source of another form is returned as is."""
    root = _ROOT.match(source)
    if root is None:
        return source
    parts = [root["name"]]
    position = root.end()
    module_root = 0
    while position < len(source):
        step = _STEP.match(source, position)
        if step is None:
            return source
        if step["kind"] and not module_root and (len(parts) == 1 or parts == ["args", "0"]):
            module_root = len(parts)
        parts.append(next(v for k, v in step.groupdict().items() if v is not None and k != "kind"))
        position = step.end()
    if not module_root and parts[0] == "kwargs" and len(parts) > 1:
        module_root = 1
    return ".".join(parts[module_root:])

