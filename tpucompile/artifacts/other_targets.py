"""Executables for compile-only targets (``options.targets``, e.g. ``tpu:v5e:2x2``): compiled here, stored
under the key a host of that target computes for the program, never loaded here."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from jax.extend.mlir import ir

from tpucompile.artifacts import stores
from tpucompile.artifacts.executables import executable_components, miss_message
from tpucompile.cache import Entry, cache_key
from tpucompile.config import Options
from tpucompile.errors import CacheMissError
from tpucompile.lowering import LoweredProgram
from tpucompile.lowering.context import mlir_context
from tpucompile.runtime import Target
from tpucompile.runtime.sharded import result_layouts
from tpucompile.runtime.targets.cross_compile import TargetCompileError, compile_for

log = logging.getLogger("tpucompile")


@dataclasses.dataclass(frozen=True)
class TargetOutcome:
    """What compiling one program for one compile-only target gave."""

    target: str
    key: str
    components: dict[str, Any]
    tier: str | None
    """"local" or "remote" when the cache held the executable already; None when it was compiled now."""
    seconds: float
    saved_seconds: float
    report: dict[str, Any]
    """Bytes per chip by use and flops (from the compile, or as recorded with the cached entry)."""
    executable: Any = None
    """The (unloaded) executable, when it was compiled in this process."""
    error: TargetCompileError | None = None
    """Why the target's compiler refused the program (nothing is stored then)."""


def compile_for_target(
    program: LoweredProgram, program_sha256: str, target: Target, options: Options, tiers: stores.ArtifactTiers,
    name: str, keep_executable: bool = False,
) -> TargetOutcome:
    """The executable of ``program`` for compile-only ``target``, from the cache or compiled now and stored
    under the key a host of that target computes for it. ``keep_executable`` compiles even on a hit, so that
    the caller can read the optimised HLO (the executable cannot be loaded here). For a program partitioned
    over ``options.mesh``, the report says how each result is laid out (``result_dims``), as a run on the
    target's devices would find it."""
    components = executable_components(program, program_sha256, target, options.host_kernels,
                                       depthwise_taps=options.cpu_depthwise_taps)
    key = cache_key(components)
    start = time.perf_counter()
    cache = tiers.persistent
    found = cache.get(key) if cache is not None else None
    if found is not None and not keep_executable:
        entry, tier = found
        cache.record_hit(key, entry.compile_seconds)
        return TargetOutcome(str(target.name), key, components, tier, time.perf_counter() - start,
                             entry.compile_seconds, dict(entry.metadata.get("report") or {}))
    if found is None and tiers.strict:
        raise CacheMissError(miss_message(f"{name} for {target.name}", key, components, cache))
    with mlir_context():
        module = ir.Module.parse(program.bytecode())  # a copy: compiling may change the module it is given
    try:
        compiled = compile_for(module, target, name, "depthwise_taps" in components["rewrites"])
    except TargetCompileError as error:
        return TargetOutcome(str(target.name), key, components, None, time.perf_counter() - start, 0.0, {},
                             error=error)
    report = compiled.report()
    if program.repeated_flops and report.get("flops") is not None:  # XLA counts a loop's body once
        report["loop_flops_added"] = program.repeated_flops / max(len(target.devices), 1)  # per chip
        report["flops"] += report["loop_flops_added"]
    if options.mesh is not None and len(target.devices) > 1:
        shapes = [tuple(spec.shape) for spec in program.result_specs]
        dims = result_layouts(compiled.executable.get_output_shardings(), shapes, options.mesh.axes)
        report["result_dims"] = [None if d is None else [list(axes) for axes in d] for d in dims]
    if found is not None:
        entry, tier = found
        cache.record_hit(key, entry.compile_seconds)
        return TargetOutcome(str(target.name), key, components, tier, time.perf_counter() - start,
                             entry.compile_seconds, report, compiled.executable)
    if cache is not None:
        cache.record_miss()
        if cache.writable:
            cache.put(Entry.create(components, compiled.serialize(),
                                   {"name": name, "target": target.name, "report": report}, compiled.seconds))
    log.debug("%s: compiled for %s in %.1f ms (key %s)", name, target.name, compiled.seconds * 1e3, key[:12])
    return TargetOutcome(str(target.name), key, components, None, time.perf_counter() - start, 0.0, report,
                         compiled.executable)
