"""A model as one ATen graph for export: ``torch.export`` (which has no graph breaks), then the project's
decomposition table, so that the graph holds the ops the lowering rules know. Parameters, buffers and
constant tensors are placeholders of the graph, so they become inputs of the exported program and live in the
weights file rather than inside the program.

``F.interpolate``'s
overloads are decomposed too (the backend rewrites them in Dynamo's graph instead).

An artifact runs without PyTorch, so what the backend would run eagerly (an op without a lowering) or cut to
size on the host (an op whose result size depends on the data) cannot be exported: such a graph is refused,
naming the op and the user's source line.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch._decomp import get_decompositions
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from tpucompile import diagnostics
from tpucompile.contracts.size_expressions import runtime_symbols
from tpucompile.errors import UnsupportedOpError
from tpucompile.frontend import decomposition_table
from tpucompile.lowering.graph import has_data_dependent_size, unsupported_reason
from tpucompile.lowering.registry import is_random

_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


@dataclasses.dataclass
class GraphInput:
    """One placeholder of the exported graph."""

    name: str
    kind: str
    """``weight`` (a parameter, buffer or constant tensor, stored in the weights file) or ``user_input``."""
    meta: torch.Tensor
    weight: str | None = None
    """For a weight: its name in the weights file (the module's attribute path, ``layers.0.wq.weight``)."""


@dataclasses.dataclass
class ExportGraph:
    """The decomposed graph and what the artifact needs to describe it."""

    gm: torch.fx.GraphModule
    inputs: list[GraphInput]
    weights: dict[str, torch.Tensor]
    output_names: list[str]
    symbols: dict[sympy.Symbol, dict[str, Any]]
    """Each size symbol: ``name`` (its ``Dim``'s where known), ``min``, ``max`` (None when unbounded) and
    ``dims`` (``input:dim`` it is the size of)."""
    program: ExportedProgram


def trace(model: torch.nn.Module, example_args: Sequence[Any], dynamic_shapes: Any = None) -> ExportGraph:
    """``model`` traced by ``torch.export`` on ``example_args`` and decomposed for lowering; refuses what an
    artifact cannot run (see the module doc)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tpucompile.export takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    program = torch.export.export(model, tuple(example_args), dynamic_shapes=dynamic_shapes)
    program = program.run_decompositions(export_decompositions())
    if any(spec.kind is InputKind.TOKEN for spec in program.graph_signature.input_specs):
        # Ordering tokens around ops with effects (the error checks of linalg ops): one program runs its ops in
        # data order, so the ops are called directly, as the backend's graphs do (``unlift_effect_tokens``).
        from torch.export._remove_effect_tokens_pass import _remove_effect_tokens

        program = _remove_effect_tokens(program)
        for node in list(program.graph_module.graph.nodes):
            if node.target is torch.ops.aten._linalg_check_errors.default and not node.users:
                program.graph_module.graph.erase_node(node)  # a program cannot raise: dropped, as the backend does
        program.graph_module.recompile()
    gm = program.graph_module
    for node in gm.graph.nodes:
        _keep_user_frames(node)
    _refuse_unexportable(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    signature = program.graph_signature
    inputs, weights = [], {}
    for spec, node in zip(signature.input_specs, placeholders, strict=True):
        meta = node.meta.get("val")
        if spec.kind in _WEIGHT_KINDS:
            tensor = program.state_dict.get(spec.target) if spec.target in program.state_dict else \
                program.constants[spec.target]
            weights[spec.target] = tensor.detach()
            inputs.append(GraphInput(node.name, "weight", meta, spec.target))
        elif spec.kind is InputKind.USER_INPUT:
            if not isinstance(meta, torch.Tensor):
                raise UnsupportedOpError(f"input {node.name} is a {type(meta).__name__}: an exported program takes "
                                         "tensors only (pass numbers as tensors, or close over them)")
            inputs.append(GraphInput(node.name, "user_input", meta))
        else:
            raise UnsupportedOpError(f"input {node.name} is a {spec.kind.name.lower()}, which an exported program "
                                     "cannot hold")
    mutated = [spec.target for spec in signature.output_specs if spec.kind is not OutputKind.USER_OUTPUT]
    if mutated:
        raise UnsupportedOpError(f"the model updates {', '.join(map(str, mutated))} when it runs (a BatchNorm in "
                                 "training mode?); an exported program cannot write them back: call model.eval()")
    outputs = gm.graph.output_node().args[0]
    for out in outputs:
        if not isinstance(out, torch.fx.Node) or not isinstance(out.meta.get("val"), torch.Tensor):
            raise UnsupportedOpError(f"output {out} is not a tensor: an exported program returns tensors only")
    symbols = _symbols(program, inputs, _dim_names(dynamic_shapes, inputs))
    return ExportGraph(gm, inputs, weights, [str(o) for o in outputs], symbols, program)


def export_decompositions() -> dict[torch._ops.OpOverload, Any]:
    """The backend's table, plus PyTorch's forms of the ``F.interpolate`` overloads that the backend redirects
    before AOTAutograd (``frontend.interpolation``), a rewrite of Dynamo's graphs that ``torch.export``'s do
    not get: index arithmetic and gathers, which serve a forward pass well."""
    table = dict(decomposition_table())
    table.update(get_decompositions(_INTERPOLATION))
    return table


_INTERPOLATION = [torch.ops.aten.upsample_nearest1d.vec, torch.ops.aten.upsample_nearest2d.vec,
                  torch.ops.aten.upsample_nearest3d.vec, torch.ops.aten.upsample_linear1d.vec,
                  torch.ops.aten.upsample_bilinear2d.vec, torch.ops.aten.upsample_trilinear3d.vec]
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+, in ')


def _keep_user_frames(node: torch.fx.Node) -> None:
    """Cut the frames inside PyTorch (``nn.Conv2d.forward``, ``F.linear``...) off the end of ``node``'s stack
    trace, which ``torch.export`` records down to the library, so that messages and the program's locations
    name the user's line (the call of the module), as they do for graphs from Dynamo."""
    trace_text = node.meta.get("stack_trace")
    if not trace_text:
        return
    lines = trace_text.rstrip().splitlines()
    frames = [k for k, line in enumerate(lines) if _FRAME.match(line)]
    while len(frames) > 1 and _FRAME.match(lines[frames[-1]])["file"].startswith(_TORCH_DIR):
        lines = lines[:frames.pop()]
    node.meta["stack_trace"] = "\n".join(lines) + "\n"


def _refuse_unexportable(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        reason = unsupported_reason(node)
        if reason is not None:
            raise UnsupportedOpError(f"cannot export: {reason}; tpucompile would run it in eager PyTorch, which "
                                     "an exported program cannot")
        if has_data_dependent_size(node):
            raise UnsupportedOpError(f"cannot export: {diagnostics.describe_node(node)} has a result size that "
                                     "depends on the data, which an exported program cannot cut on the host")
        if node.op == "call_function" and is_random(node.target):
            raise UnsupportedOpError(f"cannot export: {diagnostics.describe_node(node)} draws random numbers, "
                                     "and an exported program takes no seed (call model.eval() to drop dropout)")


def _dim_names(dynamic_shapes: Any, inputs: list[GraphInput]) -> dict[sympy.Symbol, str]:
    """The name of each ``torch.export.Dim`` given for a user input dimension (``dynamic_shapes`` as a sequence
    with one entry per input: a dict or a sequence of ``Dim``), by the symbol it became."""
    user = [i for i in inputs if i.kind == "user_input"]
    if isinstance(dynamic_shapes, Mapping):
        dynamic_shapes = list(dynamic_shapes.values())
    if not isinstance(dynamic_shapes, (list, tuple)) or len(dynamic_shapes) != len(user):
        return {}
    names: dict[sympy.Symbol, str] = {}
    for given, spec in zip(user, dynamic_shapes, strict=True):
        entries = spec.items() if isinstance(spec, Mapping) else enumerate(spec or ())
        for dim, dim_spec in entries:
            name = getattr(dim_spec, "__name__", None)
            size = given.meta.shape[dim] if isinstance(dim, int) and dim < given.meta.dim() else None
            if isinstance(name, str) and name.isidentifier() and isinstance(size, torch.SymInt) \
                    and isinstance(size.node.expr, sympy.Symbol):
                names.setdefault(size.node.expr, name)
    return names if len(set(names.values())) == len(names) else {}


def _symbols(program: ExportedProgram, inputs: list[GraphInput], names: Mapping[sympy.Symbol, str]
             ) -> dict[sympy.Symbol, dict[str, Any]]:
    """Each size symbol of the user inputs with its range and the input dimensions it is the size of; every
    other dimension must be a polynomial of these (what the manifest can write and a loader evaluate)."""
    user = [i for i in inputs if i.kind == "user_input"]
    weights_symbolic = runtime_symbols([i.meta for i in inputs if i.kind == "weight"])
    if weights_symbolic:
        raise UnsupportedOpError("a weight has a dynamic size; only user inputs may have dynamic dimensions")
    symbols: dict[sympy.Symbol, dict[str, Any]] = {}
    for symbol in sorted(runtime_symbols([i.meta for i in user]), key=str):
        bounds = program.range_constraints.get(symbol)
        low = int(bounds.lower) if bounds is not None and bounds.lower.is_finite else 0
        high = int(bounds.upper) if bounds is not None and bounds.upper.is_finite else None
        dims = [f"{i.name}:{d}" for i in user for d, size in enumerate(i.meta.shape)
                if isinstance(size, torch.SymInt) and size.node.expr == symbol]
        if not dims:
            raise UnsupportedOpError(f"size {symbol} is not the size of any input dimension; an exported program "
                                     "reads each dynamic size from an input")
        symbols[symbol] = {"name": names.get(symbol, str(symbol)), "min": low, "max": high, "dims": dims}
    return symbols


def dimension(size: Any, names: Mapping[sympy.Symbol, str]) -> int | str:
    """A dimension as the manifest writes it: an int, or a polynomial with integer coefficients in the size
    symbols, written with their ``names``; other expressions are refused (a loader without sympy evaluates
    these)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = sympy.sympify(size.node.expr)
    symbols = list(names)
    if not expr.free_symbols <= set(symbols) or not expr.is_polynomial(*symbols) or not all(
            c.is_integer for c in sympy.Poly(expr, *symbols).coeffs()):
        raise UnsupportedOpError(f"size {expr} is not a polynomial of the dynamic sizes "
                                 f"({', '.join(map(str, symbols))}); an exported program cannot describe it")
    if expr.is_Integer:
        return int(expr)
    return str(expr.xreplace({s: sympy.Symbol(n, integer=True, positive=True) for s, n in names.items()}))
