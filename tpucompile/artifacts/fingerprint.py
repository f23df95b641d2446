"""One canonical encoding of an FX graph, for every key built from a graph: ATen programs and Dynamo plans.

The encoding names ops by what identifies them across processes (``aten.add.Tensor``, a function's importable
name), arguments by typed value, constants by the digest of their bytes, and never holds an object id, a
repr of an arbitrary object or a path. Anything without such a form makes the graph ``Uncacheable``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.node import _get_qualified_name

from tpucompile import diagnostics
from tpucompile.cache import canonical_json, digest
from tpucompile.contracts.donation_marks import DONATABLE
from tpucompile.errors import UnsupportedOpError
from tpucompile.lowering import ShapeBindings


class Uncacheable(Exception):
    """The graph holds something without a canonical encoding; it is compiled without the caches built on it."""


def encode_graph(gm: torch.fx.GraphModule, bindings: ShapeBindings, values: bool) -> tuple[str, str]:
    """(digest of ``gm``'s canonical encoding, digest of its nodes' source locations). ``values`` adds each
    node's dtype and concrete shape (ATen graphs, whose shapes are what a program is compiled for; a Dynamo
    graph's inputs are described by the caller)."""
    nodes = []
    locations = []
    for node in gm.graph.nodes:
        record: dict[str, Any] = {"op": node.op, "name": node.name}
        if node.op == "call_function":
            record["target"] = function_name(node.target)
        elif node.op == "call_method":
            record["target"] = str(node.target)
        elif node.op == "get_attr":
            record["target"] = str(node.target)
            attribute = _attribute(gm, str(node.target))
            if isinstance(attribute, torch.fx.GraphModule):  # a loop's body: its graph is part of the program
                record["graph"] = encode_graph(attribute, bindings, values)[0]
            else:
                record["value"] = encode_constant(attribute)
        elif node.op not in ("placeholder", "output"):
            raise Uncacheable(f"node kind {node.op}")
        if node.op != "placeholder":
            record["args"] = encode_argument(node.args, bindings)
            record["kwargs"] = encode_argument(dict(node.kwargs), bindings)
        elif DONATABLE in node.meta:
            record["donatable"] = encode_argument(node.meta[DONATABLE], bindings)
        if values:
            record["val"] = _encode_val(node.meta.get("val"), bindings)
        nodes.append(record)
        where = diagnostics.source_location(node)
        locations.append([where.file, where.line] if where else None)
    encoded: dict[str, Any] = {"nodes": nodes}
    if bindings.runtime:  # a bucketed program: its sizes above are the bucket's, these come at run time
        encoded["runtime_sizes"] = sorted(str(s) for s in bindings.runtime)
        encoded["unmerged_products"] = bindings.unmerged_products
        encoded["fixed_in_place"] = bindings.fixed_in_place
        encoded["products_on_padding"] = bindings.products_on_padding
        if bindings.input_extents:
            encoded["input_extents"] = sorted([index, list(shape)] for index, shape in bindings.input_extents.items())
    return digest(canonical_json(encoded)), digest(canonical_json({"locations": locations}))


def function_name(target: Any) -> str:
    """The identity of a graph's function: ``aten.add.Tensor`` for an ATen overload, else its importable name;
    anything local or anonymous has none."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    try:
        name = _get_qualified_name(target)
    except Exception as error:
        raise Uncacheable(f"function {target!r} has no qualified name") from error
    if "<" in name:
        raise Uncacheable(f"function {name} is local")
    return name


def _attribute(gm: torch.fx.GraphModule, path: str) -> Any:
    value: Any = gm
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def encode_argument(value: Any, bindings: ShapeBindings) -> Any:
    """A typed, JSON-able encoding of a node argument (never an object id or repr of an arbitrary object)."""
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return {"int": str(value)}
    if isinstance(value, float):
        return {"float": repr(value)}
    if isinstance(value, str):
        return {"str": value}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        try:
            return encode_argument(bindings.resolve(value), bindings)
        except Exception as error:
            raise Uncacheable(f"unresolvable size {value}") from error
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [encode_argument(v, bindings) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[str(k), encode_argument(v, bindings)] for k, v in sorted(value.items())]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)):
        return {type(value).__name__: str(value)}
    if isinstance(value, slice):
        return {"slice": [encode_argument(v, bindings) for v in (value.start, value.stop, value.step)]}
    if value is Ellipsis:  # indexing such as pairs[..., 0] (Llama's rotary embedding) holds one
        return {"ellipsis": None}
    if isinstance(value, torch._ops.OpOverload):
        return {"op": str(value)}
    raise Uncacheable(f"argument of type {type(value).__name__}")


def _encode_val(val: Any, bindings: ShapeBindings) -> Any:
    if isinstance(val, torch.Tensor):
        return {"tensor": [str(val.dtype), [_encode_size(s, bindings) for s in val.shape]]}
    if isinstance(val, (list, tuple)):
        return {"list": [_encode_val(v, bindings) for v in val]}
    try:
        return encode_argument(val, bindings)
    except Uncacheable:
        return {"type": type(val).__name__}


def _encode_size(size: Any, bindings: ShapeBindings) -> Any:
    """A concrete size, or "?" for a data-dependent one (fixed by the op and its inputs, which are encoded)."""
    try:
        return bindings.resolve(size)
    except UnsupportedOpError:
        return "?"


def encode_constant(value: Any) -> Any:
    """A constant tensor by dtype, shape and the digest of its bytes."""
    if not isinstance(value, torch.Tensor):
        raise Uncacheable(f"attribute of type {type(value).__name__}")
    # AOTAutograd calls the compiler with its fake mode active; a real constant must stay real here.
    with unset_fake_temporarily():
        data = value.detach().cpu().contiguous().reshape(-1)
        raw = data.view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
        raw_bytes = raw.numpy().tobytes()
    return {"tensor": [str(value.dtype), list(value.shape)], "sha256": digest(raw_bytes)}
