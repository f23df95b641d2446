"""The torch-aware side of the compile cache: what goes into keys, and how values become bytes and back.

Two layers, each memory → local directory → remote (``tpucompile/cache``):

* **program**: ATen graph → lowered StableHLO. Keyed by a canonical encoding of the graph (node targets,
  arguments, dtypes and concrete shapes, embedded constants' bytes; never object ids), the environment, and
  the source locations the program will carry (so a cached program never shows another file's lines). A hit
  skips lowering.
* **executable**: StableHLO → loaded XLA executable. Keyed by the program text without locations, its
  signature, the compile options without debug fields, the XLA flags and the environment (platform and its
  version, device kind and count, topology, jaxlib, tpucompile and a digest of its lowering sources). Portable
  across hosts and checkouts: nothing in it is a path, a pid, a time or a hash seed.

A graph is also compiled for every compile-only target in ``options.targets`` (``compile_for_target``): its
program is lowered for the target's platform (or taken as it is when nothing in it depends on the platform)
and its executable is stored under the key a host of that target computes, never loaded here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import time
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.fx
from jax.extend.mlir import ir
from torch._subclasses.fake_tensor import unset_fake_temporarily

from tpucompile import __version__, diagnostics
from tpucompile.cache import (
    Entry,
    MemoryStore,
    PersistentCache,
    cache_key,
    canonical_json,
    default_root,
    digest,
    executable_key_components,
    program_key_components,
)
from tpucompile.config import Options, parse_size
from tpucompile.errors import CacheMissError, UnsupportedOpError
from tpucompile.lowering import LoweredProgram, OutputSlot, ShapeBindings, TensorSpec, jax_bridge, lower_graph
from tpucompile.lowering.context import mlir_context
from tpucompile.runtime import (
    Target,
    build_flags,
    compile_module,
    compile_options,
    compile_options_fingerprint,
    kernel_choice,
)
from tpucompile.runtime.compile_only import TargetCompileError, compile_for
from tpucompile.runtime.custom_calls import prepare as prepare_custom_calls
from tpucompile.runtime.custom_calls import targets_of as custom_call_targets

log = logging.getLogger("tpucompile")

_LOWERING_DIR = pathlib.Path(__file__).resolve().parent / "lowering"
_DECOMPOSITIONS_SOURCE = pathlib.Path(__file__).resolve().parent / "passes" / "decompositions.py"

_executables: MemoryStore[Any] = MemoryStore(Options().executable_cache_size)
_programs: MemoryStore[tuple[LoweredProgram, str]] = MemoryStore(Options().executable_cache_size)
_plans: MemoryStore[dict[str, Any]] = MemoryStore(Options().executable_cache_size)
_caches: dict[tuple, PersistentCache | None] = {}


# -- environment ---------------------------------------------------------------------------------------


@functools.cache
def lowering_sources_digest() -> str:
    """SHA-256 over the ``.py`` files of ``tpucompile/lowering`` (relative paths and contents)."""
    parts = []
    for path in sorted(_LOWERING_DIR.rglob("*.py")):
        parts.append(path.relative_to(_LOWERING_DIR).as_posix().encode() + b"\0" + path.read_bytes())
    return digest(b"\0\0".join(parts))


@functools.cache
def decompositions_digest() -> str:
    """SHA-256 of what decides the decomposition table AOTAutograd gets: torch's version (its own tables)
    and the source of ``tpucompile/passes/decompositions.py`` (what we take, keep whole and add).

    Hashing the sources rather than the table itself keeps warm starts from building the table, and does
    not depend on which torch modules happen to be imported (some register ops into torch's tables)."""
    return digest(torch.__version__.encode() + b"\0" + _DECOMPOSITIONS_SOURCE.read_bytes())


def environment(target: Target) -> dict[str, Any]:
    """Everything about this machine and software that changes compiled code (``ENVIRONMENT_COMPONENTS``)."""
    return {
        **target.describe(),
        "xla_flags": build_flags(platform=target.platform),
        "tpucompile": __version__,
        "lowering_sources": lowering_sources_digest(),
        "decompositions": decompositions_digest(),
    }


def persistent_cache(options: Options) -> PersistentCache | None:
    """The persistent tiers ``options`` ask for (one instance per distinct setting), None when off."""
    if options.cache_mode == "off":
        return None
    root = options.cache_dir or str(default_root())
    settings = (os.path.abspath(os.path.expanduser(root)), options.cache_mode, options.cache_remote,
                options.cache_max_size, options.cache_remote_timeout)
    if settings not in _caches:
        try:
            _caches[settings] = PersistentCache(
                settings[0],
                mode=options.cache_mode,
                remote=options.cache_remote,
                max_size=parse_size(options.cache_max_size) if options.cache_max_size else None,
                remote_timeout=float(options.cache_remote_timeout),
            )
        except OSError as error:
            log.warning("tpucompile: cannot use the cache directory %s (%s); caching in memory only", root, error)
            _caches[settings] = None
    return _caches[settings]


def executable_cache() -> MemoryStore[Any]:
    """The process-wide in-memory tier of loaded executables."""
    return _executables


def clear_memory() -> None:
    """Forget every loaded executable, lowered program and host-kernel choice of this process (tests,
    benchmarks)."""
    _executables.clear()
    _programs.clear()
    _host_op_choices.clear()
    _plans.clear()


# -- the program layer ----------------------------------------------------------------------------------


class Uncacheable(Exception):
    """The graph holds something without a canonical encoding; it is lowered without the program cache."""


def graph_fingerprint(gm: torch.fx.GraphModule, bindings: ShapeBindings) -> tuple[str, str]:
    """(digest of the graph's canonical encoding, digest of its nodes' source locations)."""
    nodes = []
    locations = []
    for node in gm.graph.nodes:
        record: dict[str, Any] = {"op": node.op, "name": node.name}
        if node.op in ("call_function", "call_method"):
            record["target"] = diagnostics.op_name(node.target)
            record["args"] = encode_argument(node.args, bindings)
            record["kwargs"] = encode_argument(dict(node.kwargs), bindings)
        elif node.op == "output":
            record["args"] = encode_argument(node.args, bindings)
        elif node.op == "get_attr":
            record["target"] = str(node.target)
            record["value"] = encode_constant(getattr(gm, str(node.target), None))
        elif node.op != "placeholder":
            raise Uncacheable(f"node kind {node.op}")
        record["val"] = _encode_val(node.meta.get("val"), bindings)
        nodes.append(record)
        where = diagnostics.source_location(node)
        locations.append([where.file, where.line] if where else None)
    return digest(canonical_json({"nodes": nodes})), digest(canonical_json({"locations": locations}))


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
    if not isinstance(value, torch.Tensor):
        raise Uncacheable(f"attribute of type {type(value).__name__}")
    # AOTAutograd calls the compiler with its fake mode active; a real constant must stay real here.
    with unset_fake_temporarily():
        data = value.detach().cpu().contiguous().reshape(-1)
        raw = data.view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
        raw_bytes = raw.numpy().tobytes()
    return {"tensor": [str(value.dtype), list(value.shape)], "sha256": digest(raw_bytes)}


def lowered_program(
    gm: torch.fx.GraphModule,
    bindings: ShapeBindings,
    target: Target,
    options: Options,
    lowered: LoweredProgram | None = None,
) -> tuple[LoweredProgram, str, str | None]:
    """The lowered program of ``gm``: (program, SHA-256 of its text without locations, the tier it came
    from, or None when it was lowered now). ``lowered`` is the program of ``gm`` for another target, taken
    as it is when nothing in it depends on the platform."""

    def lower() -> LoweredProgram:
        if lowered is not None and not jax_bridge.holds_jax_lowerings(lowered.module):
            return dataclasses.replace(lowered, cache_key=None)
        with jax_bridge.target_platform(target.platform):
            return lower_graph(gm, bindings, verify=options.verify)

    try:
        graph, locations = graph_fingerprint(gm, bindings)
    except Uncacheable as why:
        log.debug("tpucompile: program cache skipped (%s)", why)
        program = lower()
        return program, digest(program.text(debug_info=False)), None
    components = program_key_components(graph, environment(target), locations)
    components["torch"] = torch.__version__  # lowering rules lean on torch's promotion and shape helpers
    key = cache_key(components)
    found = program_from_key(key, options)
    if found is not None:
        return found
    cache = persistent_cache(options)
    start = time.perf_counter()
    program = lower()
    seconds = time.perf_counter() - start
    program_sha256 = digest(program.text(debug_info=False))
    program.cache_key = key
    _programs.put(key, (program, program_sha256))
    metadata = _program_metadata(program, program_sha256)
    if cache is not None:
        cache.record_miss("program")
        if metadata is not None:
            cache.put(Entry.create(components, program.bytecode(), metadata, seconds))
    return program, program_sha256, None


def program_from_key(key: str, options: Options) -> tuple[LoweredProgram, str, str] | None:
    """(program, SHA-256 of its text without locations, tier) for a stored program key, or None."""
    cached = _programs.get(key)
    if cached is not None:
        return cached[0], cached[1], "memory"
    cache = persistent_cache(options)
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
        _programs.put(key, (program, entry.metadata["program_sha256"]))
        cache.record_hit(key, entry.compile_seconds - (time.perf_counter() - start), "program")
        return program, entry.metadata["program_sha256"], tier
    except Exception as error:  # valid bytes, unusable content: never serve it
        cache.quarantine(key, f"program entry does not load: {type(error).__name__}: {error}")
        return None


def _spec_json(spec: TensorSpec) -> list:
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
        plan.append([slot.kind, slot.index, value, [list(t) for t in slot.trim]])
    return {
        "program_sha256": program_sha256,
        "input_specs": [_spec_json(s) for s in program.input_specs],
        "input_positions": list(program.input_positions),
        "result_specs": [_spec_json(s) for s in program.result_specs],
        "output_plan": plan,
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
            OutputSlot(kind, int(index), value, tuple((int(d), int(i)) for d, i in trim))
            for kind, index, value, trim in meta["output_plan"]
        ],
    )


# -- the executable layer -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoadedExecutable:
    """A loaded executable and how it was obtained."""

    executable: Any
    key: str
    components: dict[str, Any]
    tier: str | None
    """"memory", "local" or "remote" for a cache hit; None when it was compiled now."""
    seconds: float
    """Time spent looking it up and loading or compiling it."""
    saved_seconds: float
    """For a persistent hit: the recorded compile time minus the time spent loading."""


def executable_components(
    program: LoweredProgram, program_sha256: str, target: Target, options: Options
) -> dict[str, Any]:
    return executable_key_components(
        program_sha256,
        [_spec_json(s) for s in program.input_specs],
        [_spec_json(s) for s in program.result_specs],
        compile_options_fingerprint(compile_options(target)),
        environment(target),
        _host_ops(program, program_sha256, target, options.host_kernels),
    )


_host_op_choices: dict[tuple[str, int, str], tuple[str, ...]] = {}


def _host_ops(program: LoweredProgram, program_sha256: str, target: Target, mode: str) -> tuple[str, ...]:
    """The ops of ``program`` that call the host kernels on ``target`` (``kernel_choice``), once per process."""
    if target.host_blas is None or mode == "off":
        return ()
    memo = (program_sha256, id(target), mode)
    found = _host_op_choices.get(memo)
    if found is None:
        found = _host_op_choices[memo] = kernel_choice.chosen_ops(program.bytecode(), target, mode)
    return found


def load_executable(
    program: LoweredProgram, program_sha256: str, target: Target, options: Options, name: str
) -> LoadedExecutable:
    """The loaded executable of ``program``: from memory, the local directory or the remote, or compiled
    now (by one process at a time per key) and published."""
    components = executable_components(program, program_sha256, target, options)
    key = cache_key(components)
    start = time.perf_counter()
    loaded = _executables.get(key)
    if loaded is not None:
        return LoadedExecutable(loaded, key, components, "memory", time.perf_counter() - start, 0.0)
    cache = persistent_cache(options)
    found = _load_persistent(cache, key, target) if cache is not None else None
    if found is None:
        if options.cache_mode == "strict":
            raise CacheMissError(_miss_message(name, key, components, cache))
        claim = cache.claim(key) if cache is not None else nullcontext(True)
        with claim:
            loaded = _executables.get(key)
            if loaded is not None:
                return LoadedExecutable(loaded, key, components, "memory", time.perf_counter() - start, 0.0)
            found = _load_persistent(cache, key, target) if cache is not None else None
            if found is None:
                return _compile(program, target, name, key, components, cache, start)
    loaded, entry, tier = found
    _executables.put(key, loaded)
    seconds = time.perf_counter() - start
    saved = max(0.0, entry.compile_seconds - seconds)
    if cache is not None:
        cache.record_hit(key, saved)
    log.debug("%s: executable from the %s cache in %.1f ms (key %s)", name, tier, seconds * 1e3, key[:12])
    return LoadedExecutable(loaded, key, components, tier, seconds, saved)


def _load_persistent(cache: PersistentCache, key: str, target: Target) -> tuple[Any, Entry, str] | None:
    found = cache.get(key)
    if found is None:
        return None
    entry, tier = found
    calls = entry.metadata.get("custom_calls")
    if calls is not None and not _ready_to_run(calls, key, target):
        return None
    try:
        loaded = target.client.deserialize_executable(entry.payload, target.device_list(), compile_options(target))
    except Exception as error:  # verified bytes that XLA refuses: quarantine, recompile
        cache.quarantine(key, f"XLA cannot deserialize it: {type(error).__name__}: {error}")
        return None
    # Entries written before their custom calls were recorded: read them off the loaded program.
    if calls is None and not _ready_to_run(custom_call_targets(loaded, target.platform), key, target):
        return None
    return loaded, entry, tier


def _ready_to_run(calls: list[str], key: str, target: Target) -> bool:
    """Whether this process can run a cached program that calls ``calls``, after setting up their libraries.
    A program it cannot run is a miss (the entry stays: it is sound, only this process lacks something)."""
    unready = prepare_custom_calls(calls, target.platform)
    if unready is not None:
        log.warning("tpucompile: cached executable %s not used: %s", key[:12], unready)
    return unready is None


def _compile(
    program: LoweredProgram,
    target: Target,
    name: str,
    key: str,
    components: dict[str, Any],
    cache: PersistentCache | None,
    start: float,
) -> LoadedExecutable:
    compile_start = time.perf_counter()
    loaded = compile_module(program.bytecode(), target, host_ops=components["host_ops"])
    compile_seconds = time.perf_counter() - compile_start
    _executables.put(key, loaded)
    if cache is not None:
        cache.record_miss()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: cache miss %s", name, _nearest_text(cache, components))
        if cache.writable:
            try:
                blob = target.client.serialize_executable(loaded)
            except Exception as error:
                log.debug("%s: executable not serialisable, kept in memory only: %s", name, error)
            else:
                calls = custom_call_targets(loaded, target.platform)
                cache.put(Entry.create(components, blob, {"name": name, "custom_calls": calls}, compile_seconds))
    seconds = time.perf_counter() - start
    log.debug("%s: compiled in %.1f ms (key %s)", name, compile_seconds * 1e3, key[:12])
    return LoadedExecutable(loaded, key, components, None, seconds, 0.0)


def _nearest_text(cache: PersistentCache, components: Mapping[str, Any]) -> str:
    nearest = cache.nearest("executable", dict(components))
    if nearest is None:
        return "(no entry of this kind in the local cache)"
    key, differing = nearest
    return f"(nearest entry {key[:12]} differs in: {', '.join(differing) or 'nothing'})"


def _miss_message(name: str, key: str, components: Mapping[str, Any], cache: PersistentCache | None) -> str:
    where = cache.describe()["dir"] if cache is not None else "no persistent cache"
    nearest = _nearest_text(cache, components) if cache is not None else ""
    return (
        f"{name}: no cached executable for key {key} in {where} {nearest}; cache_mode='strict' forbids "
        "compiling (warm the cache with `tpucompile warm SCRIPT.py`, or use cache_mode='read-write')"
    )



# -- the plan layer ---------------------------------------------------------------------------------------


def load_plan(components: Mapping[str, Any], options: Options) -> tuple[dict[str, Any], str] | None:
    """(plan, tier) stored under ``components``' key (see ``tpucompile.aot_cache``), or None."""
    key = cache_key(components)
    plan = _plans.get(key)
    if plan is not None:
        return plan, "memory"
    cache = persistent_cache(options)
    found = cache.get(key) if cache is not None else None
    if found is None:
        return None
    entry, tier = found
    try:
        if entry.kind != "plan":
            raise ValueError(f"entry of kind {entry.kind!r}")
        plan = json.loads(entry.payload)
        if not isinstance(plan, dict):
            raise ValueError("payload is not a JSON object")
    except Exception as error:
        cache.quarantine(key, f"plan entry does not load: {type(error).__name__}: {error}")
        return None
    _plans.put(key, plan)
    cache.record_hit(key, entry.compile_seconds, "plan")
    return plan, tier


def store_plan(components: Mapping[str, Any], plan: dict[str, Any], seconds: float, options: Options) -> None:
    """Keep ``plan`` in memory and, when the cache is writable, as a JSON entry (never pickle)."""
    _plans.put(cache_key(components), plan)
    cache = persistent_cache(options)
    if cache is not None:
        cache.record_miss("plan")
        if cache.writable:
            cache.put(Entry.create(dict(components), canonical_json(plan), {}, seconds))


# -- compile-only targets ---------------------------------------------------------------------------------


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
    program: LoweredProgram, program_sha256: str, target: Target, options: Options, name: str,
    keep_executable: bool = False,
) -> TargetOutcome:
    """The executable of ``program`` for compile-only ``target``, from the cache or compiled now and stored
    under the key a host of that target computes for it. ``keep_executable`` compiles even on a hit, so that
    the caller can read the optimised HLO (the executable cannot be loaded here)."""
    components = executable_components(program, program_sha256, target, options)
    key = cache_key(components)
    start = time.perf_counter()
    cache = persistent_cache(options)
    found = cache.get(key) if cache is not None else None
    if found is not None and not keep_executable:
        entry, tier = found
        cache.record_hit(key, entry.compile_seconds)
        return TargetOutcome(str(target.name), key, components, tier, time.perf_counter() - start,
                             entry.compile_seconds, dict(entry.metadata.get("report") or {}))
    if found is None and options.cache_mode == "strict":
        raise CacheMissError(_miss_message(f"{name} for {target.name}", key, components, cache))
    with mlir_context():
        module = ir.Module.parse(program.bytecode())  # a copy: compiling may change the module it is given
    try:
        compiled = compile_for(module, target, name)
    except TargetCompileError as error:
        return TargetOutcome(str(target.name), key, components, None, time.perf_counter() - start, 0.0, {},
                             error=error)
    report = compiled.report()
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
