"""The executable layer: StableHLO → loaded XLA executable, from memory, the local directory or the remote,
or compiled now (by one process at a time per key) and published.

An entry records the custom-call targets its optimised program calls; before a cached executable is loaded,
each is checked against this process's XLA registry and set up (LAPACK's kernels are found only once
initialised), and an entry this process cannot run is a logged miss, never a crash.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

from tpucompile.artifacts import stores
from tpucompile.artifacts.environment import environment
from tpucompile.artifacts.programs import spec_json
from tpucompile.cache import Entry, PersistentCache, cache_key, executable_key_components
from tpucompile.config import Options
from tpucompile.errors import CacheMissError
from tpucompile.lowering import LoweredProgram
from tpucompile.runtime import Target, compile_module, compile_options, compile_options_fingerprint
from tpucompile.runtime.custom_calls import prepare as prepare_custom_calls
from tpucompile.runtime.custom_calls import targets_of as custom_call_targets
from tpucompile.runtime.host_kernels import kernel_choice

log = logging.getLogger("tpucompile")


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
    program_check: kernel_choice.ProgramCheck | None = None
    """Set when this program has XLA's ops only until its host-kernel ops are timed in the whole program
    (``host_kernel_timing="background"``): which ops, and the verdict's signature."""


def executable_components(
    program: LoweredProgram, program_sha256: str, target: Target, host_kernels: str,
    host_ops: tuple[str, ...] | None = None, depthwise_taps: bool = True,
) -> dict[str, Any]:
    """The executable's key components; ``host_ops``: the ops that call the host kernels, None to choose them
    now (``host_ops_chosen``, timing what this machine has not timed); ``depthwise_taps``: the option of that
    name (a rewrite of CPU programs only)."""
    if host_ops is None:
        host_ops = host_ops_chosen(program, program_sha256, target, host_kernels)
    return executable_key_components(
        program_sha256,
        [spec_json(s) for s in program.input_specs],
        [spec_json(s) for s in program.result_specs],
        compile_options_fingerprint(compile_options(target)),
        environment(target),
        host_ops,
        cpu_rewrites(target, depthwise_taps),
    )


def cpu_rewrites(target: Target, depthwise_taps: bool) -> tuple[str, ...]:
    """The rewrites ``compile_module`` applies to a program for ``target`` (``runtime/compiler.for_target``)."""
    return ("depthwise_taps",) if depthwise_taps and target.platform == "cpu" else ()


def host_ops_chosen(
    program: LoweredProgram, program_sha256: str, target: Target, mode: str, defer_program_check: bool = False
) -> tuple[str, ...] | kernel_choice.ProgramCheck:
    """The ops of ``program`` that call the host kernels on ``target`` (``kernel_choice``), once per process; a
    ``kernel_choice.ProgramCheck`` where ``defer_program_check`` leaves the program's own timing for later."""
    if target.host_blas is None or mode == "off" or program.runtime_sizes:  # a kernel is a custom call,
        return ()  # whose operands XLA's dynamic padder cannot see into
    found = stores.host_op_choices.get(_choice_memo(program_sha256, target, mode))
    if found is None:
        found = kernel_choice.chosen_ops(program.bytecode(), target, mode, defer_program_check)
        if isinstance(found, tuple):
            remember_host_ops(program_sha256, target, mode, found)
    return found


def remember_host_ops(program_sha256: str, target: Target, mode: str, host_ops: tuple[str, ...]) -> None:
    """The choice for ``program`` (once made, or once its deferred check is done): later compiles in this
    process take it."""
    stores.host_op_choices[_choice_memo(program_sha256, target, mode)] = host_ops


def _choice_memo(program_sha256: str, target: Target, mode: str) -> tuple[str, int, str]:
    return program_sha256, id(target), mode


def load_executable(
    program: LoweredProgram, program_sha256: str, target: Target, options: Options, tiers: stores.ArtifactTiers,
    name: str, host_ops: tuple[str, ...] | None = None,
) -> LoadedExecutable:
    """The loaded executable of ``program``: from memory, the local directory or the remote, or compiled
    now (by one process at a time per key) and published; with the ``host_ops`` given, or those chosen now.
    With ``host_kernel_timing="background"``, a program whose chosen ops await the timing of the whole
    program comes with XLA's ops and says so (``program_check``)."""
    check = None
    if host_ops is None:
        defer = options.host_kernel_timing == "background" and not tiers.strict  # strict: nothing compiled later
        host_ops = host_ops_chosen(program, program_sha256, target, options.host_kernels, defer)
        if isinstance(host_ops, kernel_choice.ProgramCheck):
            check, host_ops = host_ops, ()
    components = executable_components(program, program_sha256, target, options.host_kernels, host_ops,
                                       options.cpu_depthwise_taps)
    key = cache_key(components)
    start = time.perf_counter()
    loaded = tiers.get(stores.executables, key)
    if loaded is not None:
        return LoadedExecutable(loaded, key, components, "memory", time.perf_counter() - start, 0.0, check)
    cache = tiers.persistent
    found = _load_persistent(cache, key, target) if cache is not None else None
    if found is None:
        if tiers.strict:
            raise CacheMissError(miss_message(name, key, components, cache))
        claim = cache.claim(key) if cache is not None else nullcontext(True)
        with claim:
            loaded = tiers.get(stores.executables, key)
            if loaded is not None:
                return LoadedExecutable(loaded, key, components, "memory", time.perf_counter() - start, 0.0,
                                        check)
            found = _load_persistent(cache, key, target) if cache is not None else None
            if found is None:
                return dataclasses.replace(_compile(program, target, name, key, components, start, tiers),
                                           program_check=check)
    loaded, entry, tier = found
    tiers.put(stores.executables, key, loaded)
    seconds = time.perf_counter() - start
    saved = max(0.0, entry.compile_seconds - seconds)
    if cache is not None:
        cache.record_hit(key, saved)
    log.debug("%s: executable from the %s cache in %.1f ms (key %s)", name, tier, seconds * 1e3, key[:12])
    return LoadedExecutable(loaded, key, components, tier, seconds, saved, check)


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
    start: float,
    tiers: stores.ArtifactTiers,
) -> LoadedExecutable:
    cache = tiers.persistent
    compile_start = time.perf_counter()
    loaded = compile_module(program.bytecode(), target, host_ops=components["host_ops"],
                            depthwise_taps="depthwise_taps" in components["rewrites"])
    compile_seconds = time.perf_counter() - compile_start
    tiers.put(stores.executables, key, loaded)
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


def miss_message(name: str, key: str, components: Mapping[str, Any], cache: PersistentCache | None) -> str:
    """Why ``cache_mode='strict'`` refused to compile, with the nearest entry's differing components."""
    where = cache.describe()["dir"] if cache is not None else "no persistent cache"
    nearest = _nearest_text(cache, components) if cache is not None else ""
    return (
        f"{name}: no cached executable for key {key} in {where} {nearest}; cache_mode='strict' forbids "
        "compiling (warm the cache with `tpucompile warm SCRIPT.py`, or use cache_mode='read-write')"
    )
