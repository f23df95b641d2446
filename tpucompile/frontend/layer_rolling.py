"""Roll a model's repeated layers into one loop: runs of identical blocks in Dynamo's graph become one
``torch.ops.higher_order.scan`` over their parameters stacked per layer.

Dynamo unrolls ``for layer in self.layers`` into one copy of the layer's ops per layer, and XLA's compile time
grows faster than the program. The repetition is found here, in the torch-level graph, because this is the
only graph that still says which module each op came from (``nn_module_stack``) and because a ``scan`` put
here is differentiated by AOTAutograd itself: its forward saves each iteration's intermediates stacked, and
its backward is a reverse ``scan`` over them, both of which lower to a ``stablehlo.while``
(``lowering/rules/loops.py``).

A run is rolled only when it is proved the same computation per layer:

* its layers are consecutive items of one ``ModuleList``/``Sequential`` of one class, each one contiguous
  stretch of the graph;
* their ops are the same, in the same order, with the same constants and the same shapes and dtypes;
* each layer reads only (a) values of the layer before it, the same in every layer (the carry: the hidden
  state), (b) one value that all layers share (rotary tables, a mask), or (c) a value of its own made before
  the run (its parameters), stacked for the loop; and what else leaves it is read only after the run (a
  key/value cache's entries), which the loop returns stacked and the graph reads back per layer.

Anything else (an in-place update, a random op, a layer whose values escape, layers that differ) keeps the run
unrolled, and the reason is recorded in the graph's meta (``ROLLING_KEY``), which the dump shows. A run whose
layers differ in the middle (a sliding-window layer among global ones) is split into the longest runs that
are identical.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

ROLLING_KEY = "tpucompile_rolling"
"""Graph meta: what was rolled (``"rolled <prefix>[i:j]: n layers"``) and what was not, with why."""

LAYER_STACK_KEY = "tpucompile_layer_stack"
"""Node meta, on the concatenation that stacks one input of a rolled run's layers (``parameter_stacks`` takes
such stacks of parameters out of the program)."""

MIN_RUN = 2
"""The fewest identical layers worth a loop."""

_INDEXED = re.compile(r"^(?P<prefix>.+?)(?:\.(?P<dot>\d+)|\[(?P<bracket>\d+)\])$")

_RANDOM_NAMES = ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "multinomial",
                 "normal", "uniform", "randperm", "poisson")
_SUMS = {operator.add, operator.sub, torch.add, torch.sub, "add", "sub"}
"""Ops whose gradient never reads their result: a carry they make needs no copy of its own."""
_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


@dataclasses.dataclass
class _Layer:
    prefix: str
    index: int
    kind: type | str
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    signature: tuple = ()


@dataclasses.dataclass
class _Plan:
    """How a run of identical layers becomes one scan."""

    layers: list[_Layer]
    carries: list[tuple[int, int]]
    """(input position, local index of the node of the layer before that feeds it)."""
    stacked: list[int]
    """Input positions read per layer (its own parameters), stacked along a new first axis."""
    shared: list[int]
    """Input positions every layer reads the same value at."""
    stacked_out: list[int]
    """Local indices of values that leave each layer for later (a key/value cache's entry, a layer's hidden
    state kept for the output): returned stacked by the loop, each layer's read back by index."""


@dataclasses.dataclass(frozen=True)
class Rolling:
    """What ``roll_repeated_layers`` did to a graph."""

    notes: list[str]
    """One line per run rolled or left unrolled, with why (also in the graph's meta, ``ROLLING_KEY``)."""
    unrolled: torch.fx.GraphModule | None
    """The graph as it was before its first run was rolled, for a compile that cannot take the loop; None when
    nothing was rolled (the graph is as it was)."""


def roll_repeated_layers(gm: torch.fx.GraphModule) -> Rolling:
    """Rewrite each run of at least ``MIN_RUN`` identical layers of ``gm`` into one scan. A failure of the
    rewrite itself leaves ``gm`` as it was, with the reason among the notes."""
    notes: list[str] = []
    unrolled = None
    rolled = 0
    try:
        layers = _layers(gm)
        by_prefix: dict[str, list[_Layer]] = {}
        for layer in layers:
            by_prefix.setdefault(layer.prefix, []).append(layer)
        for prefix, group in by_prefix.items():
            group.sort(key=lambda layer: layer.index)
            for run, reason in _runs(group):
                span = f"{prefix}[{run[0].index}:{run[-1].index + 1}]"
                plan = _plan(run) if reason is None else reason
                if isinstance(plan, str):
                    notes.append(f"unrolled {span}: {plan}")
                    continue
                if unrolled is None:
                    unrolled = graph_copy(gm)
                replaced = _rewrite(gm, plan, f"rolled_layers_{rolled}")
                rolled += 1
                for layer in layers:  # a later run may read this one's values, which now come out of the loop
                    layer.inputs = [replaced.get(value, value) for value in layer.inputs]
                notes.append(f"rolled {span}: {len(run)} layers, {len(plan.stacked)} stacked inputs, "
                             f"{len(plan.carries)} carried, {len(plan.shared)} shared, {len(plan.stacked_out)} "
                             "stacked outputs")
    except Exception as error:  # never a failed compile: the layers as Dynamo traced them
        if unrolled is not None:
            gm.graph = unrolled.graph
        notes, unrolled = [f"unrolled: rolling failed ({type(error).__name__}: {error})"], None
    if unrolled is not None:
        gm.graph.lint()
        gm.recompile()
    gm.meta[ROLLING_KEY] = notes
    return Rolling(notes, unrolled)


def graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm``'s graph (its nodes' meta shared) over the same module: rewriting either leaves the other
    as it is (the unrolled graph kept for a failed loop; the graph whose stacks ``parameter_stacks`` takes
    out)."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def _layer_key(node: torch.fx.Node) -> tuple[str, int, Any] | None:
    """The outermost indexed module (``...layers.3``) the node was traced in: (prefix, index, module type)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, kind in stack.values():
        match = _INDEXED.match(path)
        if match:
            index = match.group("dot") or match.group("bracket")
            return match.group("prefix"), int(index), kind
    return None


def _layers(gm: torch.fx.GraphModule) -> list[_Layer]:
    """The graph's indexed layers, each with its ops in graph order (placeholders are inputs, never ops)."""
    found: dict[tuple[str, int], _Layer] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module", "get_attr"):
            continue
        key = _layer_key(node)
        if key is None:
            continue
        prefix, index, kind = key
        layer = found.setdefault((prefix, index), _Layer(prefix, index, kind, []))
        layer.nodes.append(node)
    for layer in found.values():
        members = set(layer.nodes)
        inputs: dict[torch.fx.Node, None] = {}
        for node in layer.nodes:
            for arg in node.all_input_nodes:
                if arg not in members:
                    inputs.setdefault(arg)
        layer.inputs = list(inputs)
        layer.signature = _signature(layer)
    return list(found.values())


def _runs(group: list[_Layer]) -> Iterable[tuple[list[_Layer], str | None]]:
    """Maximal runs of consecutive, contiguous, identical layers of one module list (a run shorter than
    ``MIN_RUN`` with why it is)."""
    run: list[_Layer] = []
    why_split = ""
    for layer in group:
        if run and (layer.index != run[-1].index + 1 or layer.kind != run[-1].kind
                    or layer.signature != run[-1].signature):
            why_split = ("its layers' ops differ" if layer.index == run[-1].index + 1 else "its indices are not "
                         "consecutive")
            yield from _closed(run, why_split)
            run = []
        run.append(layer)
    yield from _closed(run, why_split)


def _closed(run: list[_Layer], why_split: str) -> Iterable[tuple[list[_Layer], str | None]]:
    if not run:
        return
    if len(run) < MIN_RUN:
        yield run, f"a single layer ({why_split or 'no identical neighbour'})"
        return
    broken = next((why for layer in run if (why := _unrollable(layer)) is not None), None)
    yield run, broken


def _unrollable(layer: _Layer) -> str | None:
    """Why a layer cannot be an iteration of a loop, else None."""
    if any(node.next is not following for node, following in itertools.pairwise(layer.nodes)):
        return "its ops are interleaved with others'"
    for node in layer.nodes:
        name = _name(node)
        if _symbolic(_example(node)):
            return f"{node.name} has symbolic sizes (a rolled loop is compiled for fixed ones)"
        if _complex(_example(node)):
            return f"{node.name} is complex (PyTorch's scan differentiates real values only)"
        if node.op in ("call_module", "get_attr"):
            return f"it calls {node.op} {node.target}"
        if (name.endswith("_") and not name.endswith("__")) or name in ("setitem", "copy_", "_set_grad_enabled"):
            return f"{name} updates a value in place"
        if name in _RANDOM_NAMES or (name in _DROPOUTS and _dropout_active(node)):
            return f"{name} draws random numbers"
        if "autocast" in name or "grad_enabled" in name or isinstance(node.target, torch._ops.HigherOrderOperator):
            return f"it runs {name}"
    return None


def _symbolic(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in value.shape)
    if isinstance(value, (list, tuple)):
        return any(_symbolic(v) for v in value)
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _complex(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype.is_complex
    return isinstance(value, (list, tuple)) and any(_complex(v) for v in value)


def _dropout_active(node: torch.fx.Node) -> bool:
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return not (p == 0 or training is False)


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _signature(layer: _Layer) -> tuple:
    """What must be equal for two layers to be the same computation: each op, its constants, how it reads
    the layer's own values and inputs (by position), and the shape and dtype of what it makes."""
    local = {node: k for k, node in enumerate(layer.nodes)}
    position = {node: k for k, node in enumerate(layer.inputs)}

    def arg(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return ("local", local[value]) if value in local else ("input", position[value], _value_key(value))
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(arg(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((k, arg(v)) for k, v in value.items()))
        if isinstance(value, slice):
            return ("slice", arg(value.start), arg(value.stop), arg(value.step))
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", str(value))
        if isinstance(value, torch.Tensor):
            return ("tensor", id(value))
        return (type(value).__name__, value if _hashable(value) else repr(value))

    return tuple((node.op, _target_key(node.target), arg(node.args), arg(node.kwargs), _value_key(node))
                 for node in layer.nodes)


def _target_key(target: Any) -> Any:
    return target if _hashable(target) else repr(target)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _value_key(node: torch.fx.Node) -> Any:
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(str(s) for s in value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(("tensor", tuple(str(s) for s in v.shape), v.dtype) if isinstance(v, torch.Tensor)
                     else type(v).__name__ for v in value)
    return type(value).__name__


def _plan(run: list[_Layer]) -> _Plan | str:
    """How ``run`` reads its inputs and what leaves it, or why it cannot be a loop."""
    members = [set(layer.nodes) for layer in run]
    first_order = {node: k for k, node in enumerate(run[0].nodes[0].graph.nodes)}
    start = first_order[run[0].nodes[0]]
    carries, stacked, shared = [], [], []
    for k in range(len(run[0].inputs)):
        values = [layer.inputs[k] for layer in run]
        sources = [run[t - 1].nodes.index(values[t]) if values[t] in members[t - 1] else None
                   for t in range(1, len(run))]
        if all(s is not None for s in sources) and len(set(sources)) == 1:
            if not isinstance(_example(values[0]), torch.Tensor):
                return f"it carries a non-tensor value ({values[0].name})"
            carries.append((k, sources[0]))
        elif any(any(v in m for m in members) for v in values):
            return f"layer input {k} ({values[-1].name}) comes from a layer other than the one before"
        elif all(v is values[0] for v in values):
            shared.append(k)
        elif all(isinstance(_example(v), torch.Tensor) and first_order[v] < start for v in values):
            stacked.append(k)
        else:
            return f"layer input {k} ({values[-1].name}) differs per layer and is not a tensor made before the run"
    if not carries:
        return "no value passes from one layer to the next"
    carried = {source for _, source in carries}
    everything = set().union(*members)
    stacked_out: set[int] = set()
    for t, layer in enumerate(run):
        for local, node in enumerate(layer.nodes):
            outside = [u for u in node.users if u not in members[t]]
            if not outside:
                continue
            later = [u for u in outside if u not in everything]
            if local not in carried or (later and t < len(run) - 1):
                value, carry = _example(node), _example(run[0].inputs[carries[0][0]])
                if not isinstance(value, torch.Tensor):
                    return f"{node.name} leaves its layer but is not a tensor"
                if carry.requires_grad and not value.requires_grad:
                    return (f"{node.name} leaves its layer without a gradient (PyTorch's scan differentiates only "
                            "outputs that have one)")
                following = members[t + 1] if t + 1 < len(run) and local in carried else set()
                if any(u in everything and u not in following for u in outside):
                    return f"{node.name} is read by another layer than the next"
                stacked_out.add(local)
            elif t < len(run) - 1 and any(u not in members[t + 1] for u in outside):
                return f"{node.name} is read beyond the next layer"
    return _Plan(run, carries, stacked, shared, sorted(stacked_out))


def _example(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _rewrite(gm: torch.fx.GraphModule, plan: _Plan, name: str) -> dict[torch.fx.Node, torch.fx.Node]:
    """Replace the run's nodes with ``scan(body, carries, stacked parameters, shared inputs)``; returns the nodes
    that now stand for the run's values read after it (its last carries, its layers' stacked outputs)."""
    first, last = plan.layers[0], plan.layers[-1]
    body = _body(gm, plan)
    gm.add_submodule(name, body)
    graph = gm.graph
    with graph.inserting_before(first.nodes[0]):
        stacked, rows = [], []
        for k in plan.stacked:
            # Stacked as a concatenation of the layers' values, each with a new leading axis: its ATen form
            # (unsqueeze, cat) keeps each device's block of a split parameter where it lies, where torch.stack's
            # (a concatenation along the parameters' first axis, then a view) interleaves the devices' blocks.
            layer_rows = []
            for value in [layer.inputs[k] for layer in plan.layers]:
                row = graph.call_function(torch.unsqueeze, (value, 0))
                row.meta["example_value"] = _example(value).unsqueeze(0)
                layer_rows.append(row)
            rows += layer_rows
            node = graph.call_function(torch.cat, (layer_rows, 0))
            node.meta[LAYER_STACK_KEY] = True
            node.meta["example_value"] = _stacked_example([_example(layer.inputs[k]) for layer in plan.layers])
            stacked.append(node)
        body_node = graph.get_attr(name)
        inits = [_own(graph, first.inputs[k]) for k, _ in plan.carries]
        shared = [first.inputs[k] for k in plan.shared]
        scan = graph.call_function(torch.ops.higher_order.scan, (body_node, inits, stacked, shared))
        outs = [_stacked_example([_example(layer.nodes[local]) for layer in plan.layers])
                for local in plan.stacked_out]
        scan.meta["example_value"] = [_example(last.nodes[source]) for _, source in plan.carries] + outs
        results = []
        for j, (_, source) in enumerate(plan.carries):
            result = graph.call_function(operator.getitem, (scan, j))
            result.meta["example_value"] = _example(last.nodes[source])
            result.meta["nn_module_stack"] = dict(last.nodes[source].meta.get("nn_module_stack", {}))
            results.append(result)
        pieces: dict[torch.fx.Node, torch.fx.Node] = {}
        for j, local in enumerate(plan.stacked_out):
            stack = graph.call_function(operator.getitem, (scan, len(plan.carries) + j))
            stack.meta["example_value"] = outs[j]
            for t, layer in enumerate(plan.layers):
                piece = graph.call_function(torch.select, (stack, 0, t))
                piece.meta["example_value"] = _example(layer.nodes[local])
                pieces[layer.nodes[local]] = piece
    run_nodes = set().union(*(set(layer.nodes) for layer in plan.layers))
    for node, piece in pieces.items():
        node.replace_all_uses_with(piece, delete_user_cb=lambda user: user not in run_nodes)
    trace = first.nodes[0].meta.get("stack_trace")  # the new ops point at the first layer's call site
    if trace:
        for node in [*rows, *stacked, scan, *results, *pieces.values()]:
            node.meta["stack_trace"] = trace
    members = set(last.nodes)
    for (_, source), result in zip(plan.carries, results, strict=True):
        node = last.nodes[source]
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in members)
    for layer in reversed(plan.layers):
        for node in reversed(layer.nodes):
            graph.erase_node(node)
    return {**pieces, **{last.nodes[source]: result for (_, source), result in zip(plan.carries, results,
                                                                                      strict=True)}}


def _own(graph: torch.fx.Graph, value: torch.fx.Node) -> torch.fx.Node:
    """``value``, copied when it is a graph input: PyTorch's scan refuses a carry that starts as one (it may
    alias the loop's outputs)."""
    if value.op != "placeholder":
        return value
    copy = graph.call_function(torch.clone, (value,))
    copy.meta["example_value"] = _example(value)
    return copy


def _stacked_example(examples: list[Any]) -> Any:
    """The stacked value's example, made in the first value's fake mode (parameters and activations may come
    from different ones)."""
    first = examples[0]
    mode = getattr(first, "fake_mode", None)
    shape = (len(examples), *first.shape)
    if mode is None:
        return torch.empty(shape, dtype=first.dtype, device="meta")
    with mode:
        return torch.empty(shape, dtype=first.dtype, device=first.device, requires_grad=any(
            e.requires_grad for e in examples))


def _body(gm: torch.fx.GraphModule, plan: _Plan) -> torch.fx.GraphModule:
    """One layer's ops as a graph of (carries, this layer's slice of each stacked input, shared inputs) that
    returns the carries it passes on."""
    layer = plan.layers[0]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for role, positions in (("carry", [k for k, _ in plan.carries]), ("layer", plan.stacked),
                            ("shared", plan.shared)):
        for k in positions:
            source = layer.inputs[k]
            placeholder = graph.placeholder(f"{role}_{k}_{source.name}")
            placeholder.meta = {key: value for key, value in source.meta.items()
                                if key in ("example_value", "val", "tensor_meta")}
            env[source] = placeholder
    for node in layer.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    # PyTorch's scan returns the values its backward reads as more outputs, and refuses a loop whose outputs
    # are the same tensor twice: a stacked output (a key kept for the cache and saved) is a copy of its own,
    # and so is a carry whose op's gradient reads its result (a tanh), but not a residual sum's
    def own(local: int, always: bool) -> torch.fx.Node:
        node = env[layer.nodes[local]]
        if not always and node.target in _SUMS:
            return node
        copy = graph.call_function(torch.clone, (node,))
        copy.meta["example_value"] = _example(layer.nodes[local])
        return copy

    graph.output([own(source, False) for _, source in plan.carries] + [own(local, True) for local in plan.stacked_out])
    return torch.fx.GraphModule(gm, graph)
