"""The program layer: ATen graph → lowered StableHLO, cached so that a hit skips lowering.

Keyed by the graph's canonical encoding (``fingerprint``, which holds the donation marks), the environment,
the kinds of marked arguments the program donates, the JAX lowerings registered for its custom ops (by the
digest of each function's source), and the source locations the program will carry (so a
cached program never shows another file's lines). The entry holds the module's
bytecode and, as JSON, what else rebuilds the ``LoweredProgram`` (specs, input positions, output plan).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
import torch.fx
from jax.extend.mlir import ir

from tpucompile.artifacts import stores
from tpucompile.artifacts.environment import environment
from tpucompile.artifacts.fingerprint import Uncacheable, encode_graph
from tpucompile.cache import Entry, cache_key, digest, program_key_components
from tpucompile.config import Options
from tpucompile.contracts.donation_marks import SAVED_ON_DEVICE, donated_kinds
from tpucompile.lowering import LoweredProgram, ShapeBindings, TensorSpec, custom_ops, jax_bridge, lower_graph
from tpucompile.lowering.context import mlir_context
from tpucompile.runtime import OutputSlot, Target

log = logging.getLogger("tpucompile")


def lowered_program(
    gm: torch.fx.GraphModule,
    bindings: ShapeBindings,
    target: Target,
    options: Options,
    tiers: stores.ArtifactTiers,
    lowered: LoweredProgram | None = None,
) -> tuple[LoweredProgram, str, str | None]:
    """The lowered program of ``gm``: (program, SHA-256 of its text without locations, the tier it came
    from, or None when it was lowered now). ``lowered`` is the program of ``gm`` for another target, taken
    as it is when nothing in it depends on the platform."""

    donate = donated_kinds(options.donate, target.compile_only, target.platform, len(target.devices),
                           bool(gm.meta.get(SAVED_ON_DEVICE)))

    def lower() -> LoweredProgram:
        if (lowered is not None and not jax_bridge.holds_jax_lowerings(lowered.module)
                and lowered.donated_kinds == donate):
            return dataclasses.replace(lowered, cache_key=None)
        with jax_bridge.target_platform(target.platform):
            return lower_graph(gm, bindings, verify=options.verify, donate=donate,
                               narrow_products=options.narrow_products,
                               narrow_elementwise=options.narrow_elementwise,
                               stacked_outputs=options.stacked_layer_outputs)

    try:
        graph, locations = encode_graph(gm, bindings, values=True)
    except Uncacheable as why:
        log.debug("tpucompile: program cache skipped (%s)", why)
        program = lower()
        return program, digest(program.text(debug_info=False)), None
    ops = {node.target for node in gm.graph.nodes if node.op == "call_function"}
    components = program_key_components(graph, environment(target), locations, sorted(donate),
                                        custom_ops.key_component(ops, target.platform),
                                        {"narrow_products": options.narrow_products,
                                         "narrow_elementwise": options.narrow_elementwise,
                                         "stacked_layer_outputs": options.stacked_layer_outputs})
    key = cache_key(components)
    found = program_from_key(key, tiers)
    if found is not None:
        return found
    cache = tiers.persistent
    start = time.perf_counter()
    program = lower()
    seconds = time.perf_counter() - start
    program_sha256 = digest(program.text(debug_info=False))
    program.cache_key = key
    tiers.put(stores.programs, key, (program, program_sha256))
    metadata = _program_metadata(program, program_sha256)
    if cache is not None:
        cache.record_miss("program")
        if metadata is not None:
            cache.put(Entry.create(components, program.bytecode(), metadata, seconds))
    return program, program_sha256, None


def program_from_key(key: str, tiers: stores.ArtifactTiers) -> tuple[LoweredProgram, str, str] | None:
    """(program, SHA-256 of its text without locations, tier) for a stored program key, or None."""
    cached = tiers.get(stores.programs, key)
    if cached is not None:
        return cached[0], cached[1], "memory"
    cache = tiers.persistent
    found = cache.get(key) if cache is not None else None
    if found is None:
        return None
    entry, tier = found
    try:
        start = time.perf_counter()
        if entry.kind != "program":
            raise ValueError(f"entry of kind {entry.kind!r}")
        program = _program_from_entry(entry)
        program.cache_key = key
        tiers.put(stores.programs, key, (program, entry.metadata["program_sha256"]))
        cache.record_hit(key, entry.compile_seconds - (time.perf_counter() - start), "program")
        return program, entry.metadata["program_sha256"], tier
    except Exception as error:  # valid bytes, unusable content: never serve it
        cache.quarantine(key, f"program entry does not load: {type(error).__name__}: {error}")
        return None


def spec_json(spec: TensorSpec) -> list:
    return [str(spec.dtype).removeprefix("torch."), list(spec.shape)]


def _spec_from_json(value: list) -> TensorSpec:
    dtype = getattr(torch, value[0])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {value[0]!r}")
    return TensorSpec(tuple(int(s) for s in value[1]), dtype)


def _program_metadata(program: LoweredProgram, program_sha256: str) -> dict[str, Any] | None:
    """Everything but the module needed to rebuild ``program``; None when a constant output has no JSON form."""
    plan = []
    for slot in program.output_plan:
        value = slot.value
        if not (value is None or isinstance(value, (bool, int, float))) or (
            isinstance(value, float) and not math.isfinite(value)
        ):
            return None
        plan.append([slot.kind, slot.index, value, [list(t) for t in slot.trim], slot.part])
    return {
        "program_sha256": program_sha256,
        "input_specs": [spec_json(s) for s in program.input_specs],
        "input_positions": list(program.input_positions),
        "result_specs": [spec_json(s) for s in program.result_specs],
        "output_plan": plan,
        "input_aliases": list(program.input_aliases),
        "donated_kinds": sorted(program.donated_kinds),
        "runtime_sizes": list(program.runtime_sizes),
        "repeated_flops": program.repeated_flops,
    }


def _program_from_entry(entry: Entry) -> LoweredProgram:
    meta = entry.metadata
    with mlir_context():
        module = ir.Module.parse(entry.payload)
    return LoweredProgram(
        module=module,
        input_specs=[_spec_from_json(s) for s in meta["input_specs"]],
        input_positions=[int(p) for p in meta["input_positions"]],
        result_specs=[_spec_from_json(s) for s in meta["result_specs"]],
        output_plan=[
            OutputSlot(kind, int(index), value, tuple((int(d), int(i)) for d, i in trim),
                       None if not part or part[0] is None else int(part[0]))
            for kind, index, value, trim, *part in meta["output_plan"]
        ],
        input_aliases=[None if a is None else int(a) for a in meta.get("input_aliases", [])],
        donated_kinds=frozenset(str(k) for k in meta.get("donated_kinds", [])),
        runtime_sizes=tuple(str(k) for k in meta.get("runtime_sizes", [])),
        repeated_flops=float(meta.get("repeated_flops", 0.0)),
    )
