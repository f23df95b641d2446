"""``tpucompile.export``: a model as a directory a jax-only process can serve (``tpucompile.serving``).

The graph from ``tracing`` is lowered by the same rules as a compiled graph and each program is wrapped as a
``jax.export.Exported`` (``jax_program``). Without dynamic dimensions there is one program of static shapes.
With them (``torch.export.Dim``), the lowering rules still build static shapes, so the directory holds one
program per bucket of sizes: each is the project's bucketed program, lowered at the bucket's sizes and taking
the actual sizes as ``int32`` arguments, exact for every size up to its bucket (the ops whose result padding
would change are refused beforehand, ``padding_safety``). The manifest says which program serves which sizes
and how to pad.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
import sympy
import torch

import tpucompile
from tpucompile import serving
from tpucompile.contracts.calling_convention import SEED_POSITION
from tpucompile.errors import UnsupportedOpError
from tpucompile.exporting.jax_program import exported_program
from tpucompile.exporting.tracing import ExportGraph, dimension, trace
from tpucompile.lowering import ShapeBindings, jax_bridge, padding_safety
from tpucompile.lowering.graph import LoweredProgram, lower_graph
from tpucompile.lowering.types import NUMPY_DTYPES, TensorSpec


def export(
    model: torch.nn.Module,
    example_args: Sequence[Any],
    path: str | os.PathLike,
    dynamic_shapes: Any = None,
    buckets: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    platforms: Sequence[str] = ("cpu",),
) -> dict[str, Any]:
    """Write ``model`` (traced on ``example_args`` by ``torch.export``, with its ``dynamic_shapes``) to the
    directory ``path``: its programs in jax.export's serialisation, its weights as safetensors and
    ``manifest.json``; returns the manifest.

    ``buckets`` are the sizes programs are made for along dynamic dimensions: a list for every symbol, or a
    dict keyed by the symbol's ``input:dim`` (``"tokens:0"``) or name. By default, powers of two from 16 up to
    each ``Dim``'s ``max`` (which must then be given), and the max itself. ``platforms`` are the platforms the
    programs may run on.
    """
    graph = trace(model, example_args, dynamic_shapes)
    symbols = list(graph.symbols)
    if symbols:
        found = padding_safety.first_inexact(graph.gm, frozenset(symbols))
        if found is not None:
            raise UnsupportedOpError(f"cannot export with dynamic sizes: {found[1]}; padding to a bucket would "
                                     "change its result")
    sizes = _bucket_sizes(graph, buckets)
    _clear(path)
    programs = []
    names = {s: info["name"] for s, info in graph.symbols.items()}
    for index, bucket in enumerate(serving.bucket_grid({names[s]: v for s, v in sizes.items()})):
        bindings = ShapeBindings({s: bucket[names[s]] for s in symbols}, frozenset(symbols))
        with jax_bridge.target_platform(platforms[0]):
            lowered = lower_graph(graph.gm, bindings)
        if len(platforms) > 1 and jax_bridge.holds_jax_lowerings(lowered.module):
            raise UnsupportedOpError(f"cannot export for {', '.join(platforms)} at once: the program holds ops "
                                     "lowered through jax for one platform; export once per platform")
        if SEED_POSITION in lowered.input_positions:
            raise UnsupportedOpError("cannot export: the program draws random numbers and would need a seed")
        exported = exported_program(lowered.bytecode(), [_aval(s) for s in lowered.input_specs],
                                    [_aval(s) for s in lowered.result_specs], platforms)
        file = "program.jaxexport" if not symbols else f"program_{index}.jaxexport"
        with open(os.path.join(path, file), "wb") as stream:
            stream.write(exported.serialize())
        programs.append({"file": file, "sizes": bucket})
        if index == 0:
            first = lowered
    manifest = _manifest(graph, first, programs, platforms)
    _write_weights(graph.weights, os.path.join(path, serving.WEIGHTS))
    with open(os.path.join(path, serving.MANIFEST), "w") as stream:
        json.dump(manifest, stream, indent=2)
    return manifest


_SMALLEST_BUCKET = 16
"""Default buckets are powers of two from here (as ``Options.bucket_minimum``), so small sizes share a program.
No bucket is below 2: XLA cannot broadcast a dimension whose bound is 1 once it is marked runtime-sized."""


def _clear(path: str | os.PathLike) -> None:
    """Make ``path`` a directory without a manifest or programs of an earlier export, which a half-written
    export must not leave pointing at its files."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if name == serving.MANIFEST or (name.startswith("program") and name.endswith(".jaxexport")):
            os.remove(os.path.join(path, name))


def _bucket_sizes(graph: ExportGraph, buckets: Any) -> dict[sympy.Symbol, list[int]]:
    """The bucket sizes of each symbol, within its range; none for a graph of static shapes."""
    chosen = {}
    for symbol, info in graph.symbols.items():
        wanted = buckets
        if isinstance(buckets, Mapping):
            wanted = next((buckets[k] for k in [info["name"], *info["dims"]] if k in buckets), None)
        low, high = info["min"], info["max"]
        if wanted is None:
            if high is None:
                raise UnsupportedOpError(f"dynamic size {info['name']} ({', '.join(info['dims'])}) has no maximum: "
                                         "give the Dim a max, or pass buckets=[...] to say which sizes to export")
            wanted, size = [], _SMALLEST_BUCKET
            while size < high:
                wanted.append(size)
                size *= 2
            wanted.append(high)
        kept = sorted({int(b) for b in wanted if int(b) >= max(low, 2) and (high is None or int(b) <= high)})
        if not kept:
            raise UnsupportedOpError(f"no bucket for dynamic size {info['name']} lies in its range {low}..{high}")
        chosen[symbol] = kept
        if high is None or kept[-1] < high:
            info["max"] = kept[-1]  # the artifact serves nothing larger than its largest bucket
    return chosen


def _aval(spec: TensorSpec) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(spec.shape, _numpy_dtype(spec.dtype))


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype is torch.bfloat16 else NUMPY_DTYPES[dtype]


def _manifest(graph: ExportGraph, lowered: LoweredProgram, programs: list[dict[str, Any]],
              platforms: Sequence[str]) -> dict[str, Any]:
    symbols = {s: info["name"] for s, info in graph.symbols.items()}
    by_text = {str(s): name for s, name in symbols.items()}
    inputs = []
    for position in lowered.input_positions:
        if position >= len(graph.inputs):  # a size argument, after the tensors, in the order of the symbols
            name = by_text[lowered.runtime_sizes[position - len(graph.inputs)]]
            inputs.append({"name": name, "kind": "size", "symbol": name, "shape": [], "dtype": "int32"})
            continue
        given = graph.inputs[position]
        entry = {"name": given.name, "kind": given.kind,
                 "shape": [dimension(s, symbols) for s in given.meta.shape],
                 "dtype": str(_numpy_dtype(given.meta.dtype))}
        if given.weight is not None:
            entry["weight"] = given.weight
        inputs.append(entry)
    nodes = {str(n): n for n in graph.gm.graph.nodes}
    outputs = [{"name": name, "shape": [dimension(s, symbols) for s in nodes[name].meta["val"].shape],
                "dtype": str(_numpy_dtype(nodes[name].meta["val"].dtype))} for name in graph.output_names]
    _check_outputs(lowered, graph)
    return {
        "format": serving.FORMAT,
        "format_version": serving.FORMAT_VERSION,
        "versions": {"torch": torch.__version__, "jax": jax.__version__, "tpucompile": tpucompile.__version__},
        "platforms": list(platforms),
        "weights_file": serving.WEIGHTS,
        "inputs": inputs,
        "outputs": outputs,
        "symbols": {info["name"]: {k: v for k, v in info.items() if k != "name"} | {"symbol": str(s)}
                    for s, info in graph.symbols.items()},
        "programs": programs,
        "padding": "each user input is padded with zeros at the end of its dynamic dimensions to the sizes of the "
                   "smallest program whose sizes hold the call; the actual sizes follow the tensors as int32 "
                   "scalars; each result is cut to its output shape at the actual sizes",
        "in_spec": _tree_spec(graph.program.call_spec.in_spec),
        "out_spec": _tree_spec(graph.program.call_spec.out_spec),
    }


def _check_outputs(lowered: LoweredProgram, graph: ExportGraph) -> None:
    """Every output must be a result of the program, in order (an input returned as it is would need the
    loader to pass it through; no model worth serving does that)."""
    plan = [(slot.kind, slot.index) for slot in lowered.output_plan]
    if plan != [("result", k) for k in range(len(graph.output_names))]:
        raise UnsupportedOpError("cannot export: an output is an input returned unchanged or a repeated value; "
                                 "return computed tensors only")


def _tree_spec(spec: Any) -> str | None:
    """The pytree layout of the model's arguments or outputs, for the torch loader (None when unknown)."""
    if spec is None:
        return None
    try:
        return torch.utils._pytree.treespec_dumps(spec)
    except Exception:  # a container type pytree cannot write down: the loader then returns a flat tuple
        return None


def _write_weights(weights: Mapping[str, torch.Tensor], file: str) -> None:
    """The weights as one safetensors file, each tensor with its own contiguous storage (tied weights share
    storage, which safetensors refuses)."""
    from safetensors.torch import save_file

    tmp = file + ".tmp"
    save_file({name: tensor.detach().cpu().contiguous().clone() for name, tensor in weights.items()}, tmp)
    shutil.move(tmp, file)
