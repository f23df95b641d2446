"""Device meshes and sharding plans: how a model's parameters and inputs are laid over many devices.

A ``Mesh`` names the axes of a grid of devices (``Mesh({"data": 2, "model": 4})``). A ``ShardPlan`` maps names
to *dims*, one entry per tensor dimension saying which mesh axes split it (``("data", None)``: dimension 0
split over ``data``, dimension 1 whole). Parameters and buffers are named by their path in the compiled module
(``blocks.0.attn.qkv.weight``), inputs by the forward's argument name (``idx``), outputs by their position
(``output:0``), and the value a submodule returns by its path (``blocks.0.attn:output``, a constraint on an
intermediate value); shell-style patterns (``blocks.*.attn.qkv.weight``, ``output:*``) are allowed. Whatever a
plan does not name is replicated, and outputs come back whole.

Sharding never changes what a program computes, only where its data lives: one SPMD program is compiled and
XLA's partitioner inserts the collectives. This module is plain Python (no torch, no jax), so plans can be
built and checked anywhere; ``tpucompile.sharding.binding`` and ``annotate`` apply them to graphs.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tpucompile.errors import ShardingError

Axes = tuple[str, ...]
"""The mesh axes one tensor dimension is split over, major to minor; () leaves the dimension whole."""
Dims = tuple[Axes, ...]
"""One ``Axes`` per tensor dimension."""


@dataclasses.dataclass(frozen=True, init=False)
class Mesh:
    """A logical grid of devices with named axes, e.g. ``Mesh({"data": 2, "model": 4})`` over 8 devices.

    ``devices`` lists device ids in row-major mesh order; by default the mesh takes the first
    ``size`` devices of the platform (of all processes, in id order).
    """

    axes: tuple[tuple[str, int], ...]
    devices: tuple[int, ...] | None

    def __init__(self, axes: Mapping[str, int] | Iterable[tuple[str, int]], devices: Sequence[int] | None = None):
        items = tuple((str(name), size) for name, size in (axes.items() if isinstance(axes, Mapping) else axes))
        if not items:
            raise ShardingError("a Mesh needs at least one axis, e.g. Mesh({'data': 8})")
        for name, size in items:
            if not name.isidentifier():
                raise ShardingError(f"mesh axis name {name!r} is not an identifier")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ShardingError(f"mesh axis {name!r} must have a positive int size, got {size!r}")
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise ShardingError(f"mesh axis names must be distinct, got {names}")
        object.__setattr__(self, "axes", items)
        object.__setattr__(self, "devices", None)
        size = 1
        for _, axis_size in items:
            size *= axis_size
        if devices is not None:
            devices = tuple(int(d) for d in devices)
            if len(devices) != size or len(set(devices)) != size:
                raise ShardingError(f"{self!r} needs {size} distinct device ids, got {list(devices)}")
        object.__setattr__(self, "devices", devices)

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """``"data=2,model=4"`` (the form of ``TPUCOMPILE_MESH`` and command-line flags)."""
        axes = []
        for part in text.split(","):
            name, sep, size = part.strip().partition("=")
            if not sep or not size.strip().isdigit():
                raise ShardingError(f"{text!r} is not a mesh; write axis sizes like data=2,model=4")
            axes.append((name.strip(), int(size)))
        return cls(axes)

    @property
    def size(self) -> int:
        """How many devices the mesh spans."""
        total = 1
        for _, size in self.axes:
            total *= size
        return total

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    def axis_size(self, name: str) -> int:
        return dict(self.axes)[name]

    def __repr__(self) -> str:
        text = "{" + ", ".join(f"{name!r}: {size}" for name, size in self.axes) + "}"
        return f"Mesh({text})" if self.devices is None else f"Mesh({text}, devices={list(self.devices)})"


def normalize_dims(spec: Any, where: str = "sharding spec") -> Dims:
    """``("data", None, ("x", "y"))`` → ``(("data",), (), ("x", "y"))``: the canonical, hashable form."""
    if spec is None:
        return ()
    if isinstance(spec, str):
        spec = (spec,)
    if not isinstance(spec, (list, tuple)):
        raise ShardingError(f"{where}: expected a sequence of mesh axis names (None for a whole dimension), "
                            f"got {spec!r}")
    dims = []
    for entry in spec:
        if entry is None:
            dims.append(())
        elif isinstance(entry, str):
            dims.append((entry,))
        elif isinstance(entry, (list, tuple)) and all(isinstance(a, str) for a in entry):
            dims.append(tuple(entry))
        else:
            raise ShardingError(f"{where}: each dimension is None, an axis name or a tuple of axis names, "
                                f"got {entry!r}")
    return tuple(dims)


def format_dims(dims: Dims) -> str:
    """``(('data',), ())`` → ``('data', None)``, the way a user writes it."""
    parts = ["None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(axes) for axes in dims]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One entry of a plan: the tensors whose name matches ``pattern`` get ``dims``."""

    pattern: str
    dims: Dims
    applies_to: str = "any"
    """"any" (inputs, parameters and buffers), "state" (parameters and buffers), "input" (the forward's
    arguments), "output" (the graph's outputs, named ``output:N``) or "activation" (what a submodule returns,
    named ``path:output``)."""
    optional: bool = False
    """An optional rule may match nothing, and skips tensors it does not fit (ready-made plans use it for
    "every input along dimension 0" and for biases); a required rule that does either is an error."""
    spread: str | None = None
    """Set for fully sharded data parallelism: instead of giving ``dims``, the rule adds this mesh axis ("" for
    the mesh's data axis, picked when the plan is resolved) to the first dimension it divides, on top of what
    the first matching ordinary rule says; it applies after them, wherever it stands in the plan."""


@dataclasses.dataclass(frozen=True)
class GraphValue:
    """What a plan is matched against: one input or output of a compiled graph."""

    name: str
    shape: tuple[int, ...] | None
    """None for values that are not tensors (sizes, Python numbers)."""
    is_state: bool = False
    """A parameter or buffer of the module, rather than an argument of the call."""
    dtype: str = ""
    is_output: bool = False
    is_activation: bool = False


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How a model is laid over a mesh: rules tried in order (the first that matches a tensor wins).

    Build one from a mapping (``ShardPlan.from_mapping({"idx": ("data", None)})``; a plain dict given as
    the ``shard`` option becomes one), with ``data_parallel``/``tensor_parallel``, and combine plans with
    ``+`` (the left plan's rules are tried first).
    """

    rules: tuple[Rule, ...] = ()
    mesh: Mesh | None = None
    """The mesh the plan was written for, used when the ``mesh`` option is not given."""
    bound: tuple[Dims | None, ...] | None = None
    """Set by the backend for one graph: the dims of each of its inputs (None for non-tensors)."""
    bound_outputs: tuple[Dims | None, ...] | None = None
    """Set with ``bound``: the dims of each output the plan keeps split (None: it comes back whole)."""
    bound_activations: tuple[tuple[str, Dims], ...] = ()
    """Set with ``bound``: (submodule path, dims) of each submodule whose returned value is constrained."""
    dtensors: dict[tuple[str, int], Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Set with ``bound`` when inputs are ``DTensor``s: (``"input"`` or ``"output"``, index) → (device mesh,
    placements) of the inputs, and of the outputs that come back as ``DTensor``s."""
    layouts: dict[str, Dims | None] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Filled while one graph compiles: how its forward program returned each value (by ATen node name), so
    that its backward program expects the values it takes laid out the same way."""

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], mesh: Mesh | None = None) -> ShardPlan:
        rules = []
        for pattern, spec in mapping.items():
            if not isinstance(pattern, str):
                raise ShardingError(f"sharding plan keys are parameter or input names, got {pattern!r}")
            applies_to = ("output" if pattern.startswith("output:") else "activation"
                          if pattern.endswith(":output") else "any")
            rules.append(Rule(pattern, normalize_dims(spec, f"sharding plan entry {pattern!r}"), applies_to))
        return cls(tuple(rules), mesh)

    def __add__(self, other: ShardPlan) -> ShardPlan:
        if not isinstance(other, ShardPlan):
            return NotImplemented
        if self.mesh is not None and other.mesh is not None and self.mesh != other.mesh:
            raise ShardingError(f"cannot combine plans for different meshes: {self.mesh!r} and {other.mesh!r}")
        return ShardPlan(self.rules + other.rules, self.mesh or other.mesh)

    def resolve(self, inputs: Sequence[GraphValue], mesh: Mesh) -> tuple[Dims | None, ...]:
        """The dims of each value under this plan on ``mesh`` (None for non-tensors, and for outputs no rule
        names); raises ``ShardingError`` for a rule that names an axis the mesh lacks, splits a dimension its
        axes do not divide, or matches nothing."""
        used = [False] * len(self.rules)
        resolved: list[Dims | None] = []
        for graph_input in inputs:
            if graph_input.shape is None:
                resolved.append(None)
                continue
            whole = graph_input.is_output or graph_input.is_activation
            dims: Dims | None = None if whole else ((),) * len(graph_input.shape)
            for index, rule in enumerate(self.rules):
                if rule.spread is not None or not _applies(rule, graph_input):
                    continue
                problem = _misfit(rule.dims, graph_input, mesh)
                if problem is not None:
                    if rule.optional:
                        continue
                    raise ShardingError(f"sharding plan entry {rule.pattern!r}: {problem}")
                used[index] = True
                dims = rule.dims + ((),) * (len(graph_input.shape) - len(rule.dims))
                break
            for index, rule in enumerate(self.rules):
                if rule.spread is not None and dims is not None and _applies(rule, graph_input):
                    spread = spread_dims(dims, graph_input.shape, rule.spread or _data_axis(mesh), mesh)
                    used[index] = used[index] or spread != dims
                    dims = spread
            resolved.append(dims)
        for rule, was_used in zip(self.rules, used, strict=True):
            if not was_used and not rule.optional:
                raise ShardingError(_unmatched_message(rule, inputs, mesh))
        return tuple(resolved)

    def spread_axis(self, mesh: Mesh) -> str | None:
        """The mesh axis a fully sharded plan splits everything over, gradients included (they come back laid
        out like their parameters: XLA reduce-scatters them); None for other plans."""
        rule = next((r for r in self.rules if r.spread is not None), None)
        return None if rule is None else rule.spread or _data_axis(mesh)

    def __repr__(self) -> str:
        rules = ", ".join(f"{r.pattern!r}: " + (f"spread over {r.spread or 'the data axis'}" if r.spread is not None
                                                else format_dims(r.dims)) for r in self.rules)
        text = f"ShardPlan({{{rules}}}"
        if self.mesh is not None:
            text += f", mesh={self.mesh!r}"
        return text + ")"


def _applies(rule: Rule, graph_input: GraphValue) -> bool:
    if (rule.applies_to == "output") != graph_input.is_output:
        return False
    if (rule.applies_to == "activation") != graph_input.is_activation:
        return False
    if rule.applies_to == "state" and not graph_input.is_state:
        return False
    if rule.applies_to == "input" and graph_input.is_state:
        return False
    return fnmatch.fnmatchcase(graph_input.name, rule.pattern)


def _describe(graph_input: GraphValue) -> str:
    kind = ("output" if graph_input.is_output else "value returned by" if graph_input.is_activation
            else "parameter" if graph_input.is_state else "input")
    shape = ", ".join(str(s) for s in graph_input.shape or ())
    return f"{kind} {graph_input.name!r} ({graph_input.dtype}[{shape}])" if graph_input.dtype else (
        f"{kind} {graph_input.name!r} [{shape}]")


def _misfit(dims: Dims, graph_input: GraphValue, mesh: Mesh) -> str | None:
    """Why ``dims`` cannot lay ``graph_input`` over ``mesh``, or None when it can."""
    shape = graph_input.shape or ()
    if len(dims) > len(shape):
        return (f"{format_dims(dims)} names {len(dims)} dimensions but {_describe(graph_input)} has "
                f"{len(shape)}")
    seen: set[str] = set()
    for dim, axes in enumerate(dims):
        split = 1
        for axis in axes:
            if axis not in mesh.axis_names:
                return (f"{_describe(graph_input)} dimension {dim} is split over mesh axis {axis!r}, which "
                        f"{mesh!r} lacks (its axes: {', '.join(mesh.axis_names)})")
            if axis in seen:
                return f"{_describe(graph_input)} uses mesh axis {axis!r} for more than one dimension"
            seen.add(axis)
            split *= mesh.axis_size(axis)
        if split > 1 and shape[dim] % split:
            over = " x ".join(f"{a}={mesh.axis_size(a)}" for a in axes)
            return (f"{_describe(graph_input)} dimension {dim} has size {shape[dim]}, which is not divisible "
                    f"by {split} (mesh axes {over} of {mesh!r})")
    return None


def spread_dims(dims: Dims, shape: Sequence[int], axis: str, mesh: Mesh) -> Dims:
    """``dims`` with ``axis`` added to the first dimension of ``shape`` that it still divides (after the axes
    already there), or ``dims`` unchanged when the axis is used already or divides no dimension."""
    if axis not in mesh.axis_names:
        raise ShardingError(f"fully sharded plan: axis {axis!r} is not an axis of {mesh!r}")
    if any(axis in axes for axes in dims):
        return dims
    for dim, size in enumerate(shape):
        split = mesh.axis_size(axis)
        for existing in dims[dim]:
            split *= mesh.axis_size(existing)
        if split > 1 and size % split == 0:
            return (*dims[:dim], (*dims[dim], axis), *dims[dim + 1:])
    return dims


def _data_axis(mesh: Mesh) -> str:
    for name in ("data", "fsdp"):
        if name in mesh.axis_names:
            return name
    if len(mesh.axes) == 1:
        return mesh.axes[0][0]
    raise ShardingError(f"{mesh!r} has no axis named 'data' or 'fsdp'; say which axis to shard over "
                        "(fully_sharded(mesh, axis=...), or the shard option 'fsdp:AXIS')")


def _unmatched_message(rule: Rule, inputs: Sequence[GraphValue], mesh: Mesh) -> str:
    names = [i.name for i in inputs if i.shape is not None and i.is_output == (rule.applies_to == "output")
             and i.is_activation == (rule.applies_to == "activation")]
    close = difflib.get_close_matches(rule.pattern, names, n=3, cutoff=0.5)
    hint = f"; closest names: {', '.join(close)}" if close else ""
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    what = {"output": "output", "activation": "submodule"}.get(rule.applies_to, "parameter or input")
    return (f"sharding plan entry {rule.pattern!r} matches no {what} of the compiled graph "
            f"(mesh {mesh!r}){hint}; the graph's tensors are named: {shown}")


# -- ready-made plans -------------------------------------------------------------------------------------


def _pick_axis(mesh: Mesh, axis: str | None, preferred: str, role: str) -> str:
    if axis is not None:
        if axis not in mesh.axis_names:
            raise ShardingError(f"{role} axis {axis!r} is not an axis of {mesh!r}")
        return axis
    if preferred in mesh.axis_names:
        return preferred
    if len(mesh.axes) == 1:
        return mesh.axes[0][0]
    raise ShardingError(f"{mesh!r} has no axis named {preferred!r}; pass {role}_axis=... to say which to use")


def data_parallel(mesh: Mesh, axis: str | None = None) -> ShardPlan:
    """Every input of the call split along dimension 0 (the batch) over ``axis`` (default ``"data"``, or the
    mesh's only axis); parameters replicated. Inputs whose first dimension the axis does not divide (a
    position index, a scalar) are replicated."""
    axis = _pick_axis(mesh, axis, "data", "data")
    return ShardPlan((Rule("*", ((axis,),), applies_to="input", optional=True),), mesh)


def fully_sharded(mesh: Mesh | None = None, axis: str | None = None) -> ShardPlan:
    """Fully sharded data parallelism (ZeRO-3, PyTorch's FSDP) over ``axis`` (default ``"data"`` or ``"fsdp"``,
    or the mesh's only axis): every tensor the program takes — parameters, and so their gradients, the
    optimiser state built from them and the optimiser step's arguments, and the batch — is split along the
    first dimension the axis divides (dimension 0 of the batch), and what cannot be split stays whole.
    Gradients come back split like their parameters. XLA's partitioner gathers each parameter where it is
    used and reduce-scatters its gradient.

    Combines with ``tensor_parallel`` on another axis (``fully_sharded(mesh) + tensor_parallel(mesh, ...)``,
    in either order): a tensor-parallel weight is split over the model axis as that plan says and over the
    data axis along the first dimension that still divides."""
    if mesh is not None and axis is not None:
        _pick_axis(mesh, axis, "data", "fsdp")
    elif mesh is not None:
        axis = _data_axis(mesh)
    return ShardPlan((Rule("*", (), applies_to="any", optional=True, spread=axis or ""),), mesh)


def tensor_parallel(
    mesh: Mesh, column: Iterable[str] = (), row: Iterable[str] = (), axis: str | None = None
) -> ShardPlan:
    """Megatron-style tensor parallelism over ``axis`` (default ``"model"``, or the mesh's only axis).

    ``column`` and ``row`` are module-name patterns of ``Linear`` layers. A column-parallel layer splits its
    output features (weight dimension 0 and the bias); a row-parallel one splits its input features (weight
    dimension 1), so a column layer followed by a row layer — attention's QKV then output projection, an
    MLP's up then down projection — needs one all-reduce, which XLA inserts.
    """
    axis = _pick_axis(mesh, axis, "model", "model")
    column, row = _patterns(column, "column"), _patterns(row, "row")
    rules = []
    for pattern in column:
        rules.append(Rule(f"{pattern}.weight", ((axis,), ()), applies_to="state"))
        rules.append(Rule(f"{pattern}.bias", ((axis,),), applies_to="state", optional=True))
    for pattern in row:
        rules.append(Rule(f"{pattern}.weight", ((), (axis,)), applies_to="state"))
    return ShardPlan(tuple(rules), mesh)


def _patterns(value: Iterable[str], role: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    patterns = tuple(value)
    if not all(isinstance(p, str) and p for p in patterns):
        raise ShardingError(f"tensor_parallel({role}=...) takes module-name patterns, got {patterns!r}")
    return patterns


# -- options and the graph annotation -------------------------------------------------------------------


def mesh_option(value: Any) -> Mesh | None:
    """The ``mesh`` option: a ``Mesh``, a mapping of axis sizes, or text such as ``"data=2,model=4"``."""
    if value is None or isinstance(value, Mesh):
        return value
    if isinstance(value, str):
        return Mesh.parse(value)
    if isinstance(value, Mapping):
        return Mesh(value)
    raise ShardingError(f"tpucompile option 'mesh' must be a tpucompile.Mesh, got {value!r}")


def shard_option(value: Any) -> ShardPlan | None:
    """The ``shard`` option: a ``ShardPlan``, a mapping of names to dims, that mapping as JSON text, or
    ``"fsdp"`` / ``"fsdp:AXIS"`` (``fully_sharded`` over the ``mesh`` option's data axis, or AXIS)."""
    if value is None or isinstance(value, ShardPlan):
        return value
    if isinstance(value, str) and (value == "fsdp" or value.startswith("fsdp:")):
        axis = value.partition(":")[2].strip()
        if value.startswith("fsdp:") and not axis.isidentifier():
            raise ShardingError(f"tpucompile option 'shard' {value!r}: write 'fsdp' or 'fsdp:AXIS'")
        return fully_sharded(axis=axis or None)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ShardingError(f"tpucompile option 'shard' is not a JSON object: {error}") from None
    if isinstance(value, Mapping):
        return ShardPlan.from_mapping(value)
    raise ShardingError(f"tpucompile option 'shard' must be a ShardPlan or a mapping of names to dims, "
                        f"got {value!r}")


def shard_annotation(value: Any, sharding: str) -> Any:
    """The graph node a sharding pass inserts: ``value`` laid out as ``sharding`` (see ``encode_sharding``).

    It computes nothing; lowering turns it into an argument or result attribute or a sharding constraint.
    """
    return value


def encode_sharding(axes: tuple[tuple[str, int], ...], dims: Dims) -> str:
    """``mesh[data=2,model=4] dims[{data},{}]``: the readable, canonical text of a sharding that graph
    annotations carry (it is part of every graph's cache key)."""
    mesh = ",".join(f"{name}={size}" for name, size in axes)
    return f"mesh[{mesh}] dims[" + ",".join("{" + ",".join(a) + "}" for a in dims) + "]"


_ENCODED = re.compile(r"mesh\[(?P<mesh>[^\]]*)\] dims\[(?P<dims>.*)\]")


def decode_sharding(text: str) -> tuple[tuple[tuple[str, int], ...], Dims]:
    """The (mesh axes, dims) of an ``encode_sharding`` text."""
    match = _ENCODED.fullmatch(text)
    if match is None:
        raise ShardingError(f"not an encoded sharding: {text!r}")
    axes = tuple((name, int(size)) for name, size in (p.split("=") for p in match["mesh"].split(",")))
    dims = tuple(tuple(a for a in group.split(",") if a) for group in re.findall(r"\{([^}]*)\}", match["dims"]))
    return axes, dims
