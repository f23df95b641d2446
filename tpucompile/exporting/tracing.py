"""A model as one ATen graph for export: ``torch.export`` (which has no graph breaks), then the project's
decomposition table, so that the graph holds the ops the lowering rules know. Parameters, buffers and
constant tensors are placeholders of the graph, so they become inputs of the exported program and live in the
weights file rather than inside the program.

An artifact runs without PyTorch, so what the backend would run eagerly (an op without a lowering) or cut to
size on the host (an op whose result size depends on the data) cannot be exported: such a graph is refused,
naming the op and the user's source line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from tpucompile import diagnostics
from tpucompile.errors import UnsupportedOpError
from tpucompile.frontend import decomposition_table
from tpucompile.lowering.graph import has_data_dependent_size, unsupported_reason
from tpucompile.lowering.registry import is_random
from tpucompile.runtime.size_expressions import runtime_symbols

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
    """Each size symbol: ``min``, ``max`` (None when unbounded) and ``dims`` (``input:dim`` it is the size of)."""
    program: ExportedProgram


def trace(model: torch.nn.Module, example_args: Sequence[Any], dynamic_shapes: Any = None) -> ExportGraph:
    """``model`` traced by ``torch.export`` on ``example_args`` and decomposed for lowering; refuses what an
    artifact cannot run (see the module doc)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tpucompile.export takes a torch.nn.Module, got {type(model).__name__}")
    program = torch.export.export(model, tuple(example_args), dynamic_shapes=dynamic_shapes)
    program = program.run_decompositions(decomposition_table())
    gm = program.graph_module
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
    return ExportGraph(gm, inputs, weights, [str(o) for o in outputs], _symbols(program, inputs), program)


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


def _symbols(program: ExportedProgram, inputs: list[GraphInput]) -> dict[sympy.Symbol, dict[str, Any]]:
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
        symbols[symbol] = {"min": low, "max": high, "dims": dims}
    return symbols


def dimension(size: Any, symbols: Sequence[sympy.Symbol]) -> int | str:
    """A dimension as the manifest writes it: an int, or a polynomial with integer coefficients in the size
    symbols; other expressions are refused (a loader without sympy evaluates these)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = sympy.sympify(size.node.expr)
    if not expr.free_symbols <= set(symbols) or not expr.is_polynomial(*symbols) or not all(
            c.is_integer for c in sympy.Poly(expr, *symbols).coeffs()):
        raise UnsupportedOpError(f"size {expr} is not a polynomial of the dynamic sizes "
                                 f"({', '.join(map(str, symbols))}); an exported program cannot describe it")
    return int(expr) if expr.is_Integer else str(expr)
