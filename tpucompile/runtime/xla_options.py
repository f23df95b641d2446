"""XLA's compile options for a target, and the XLA flags that can change the code it generates (both are part
of every cache key; dump and logging settings are left out of them)."""

from __future__ import annotations

import os
import shlex

import jax.extend.backend as jax_backend
import numpy as np
from jaxlib import xla_client

from tpucompile.runtime.targets.local import Target

_compile_options: dict[tuple, object] = {}


def compile_options(target: Target, num_partitions: int | None = None) -> object:
    """XLA compile options for ``target`` (built once per target and partition count). A target of several
    devices compiles one SPMD program partitioned over all of them, in the target's device order."""
    partitions = len(target.devices) if num_partitions is None else num_partitions
    assignment = tuple(d.id for d in target.devices) if partitions > 1 else ()
    key = (id(target.client), partitions, assignment)
    options = _compile_options.get(key)
    if options is None:
        options = jax_backend.get_compile_options(
            num_replicas=1,
            num_partitions=partitions,
            device_assignment=np.array([assignment]) if assignment else None,
            backend=target.client,
        )
        if assignment:  # results the program leaves unannotated take the layout XLA's propagation finds best
            options.executable_build_options.allow_spmd_sharding_propagation_to_output = [True]
        if target.platform == "cpu":
            options.env_option_overrides = cpu_option_overrides(target.client)
        _compile_options[key] = options
    return options


CPU_SCHEDULER_FLAG = "xla_cpu_scheduler_type"
CPU_SCHEDULER = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
"""XLA's CPU compiler orders a program's instructions for concurrency by default: independent instructions
get separate buffers, so its thunk executor finds several ready at once and hands half of them to the
intra-op pool each time. For the small instructions of PyTorch graphs on a CPU the hand-off (waking a pool
thread, moving data between cores) costs more than the overlap gains; the memory-optimised order reuses
buffers, which chains the thunks so that few are ready together (docs/benchmarks.md has the measurements)."""

_USER_SCHEDULER_FLAGS = {CPU_SCHEDULER_FLAG, "xla_cpu_enable_concurrency_optimized_scheduler"}
_PROBE_MODULE = "func.func public @main(%x: tensor<f32>) -> tensor<f32> { return %x : tensor<f32> }"
_cpu_overrides: dict[int, list[tuple[str, object]]] = {}


CPU_OPTIMIZATION_LEVEL_VARIABLE = "TPUCOMPILE_XLA_CPU_OPTIMIZATION_LEVEL"
"""LLVM's optimisation level for programs compiled for the CPU (0-3; unset: XLA's own, 3). Level 0 halves XLA's
CPU compile time for PyTorch-sized graphs and slows what it generates, the trade a test suite or a first try
on a laptop wants; unlike ``--xla_backend_optimization_level`` in ``XLA_FLAGS``, it leaves TPU and GPU compiles
in the same process alone. It is one of the compile options, so it is part of every CPU cache key, and, like
them, read when a CPU client's options are first built (once per client and partition count), as XLA reads
``XLA_FLAGS`` once."""


def cpu_option_overrides(client: object, environ: dict[str, str] | None = None) -> list[tuple[str, object]]:
    """The XLA options tpucompile sets for compiles on ``client`` (a CPU client): the memory-optimised
    scheduler, unless ``XLA_FLAGS`` chooses a scheduler itself or this jaxlib's XLA does not know the option
    (checked once per client with a one-instruction compile, which fails on the option before compiling
    anything); and the optimisation level ``TPUCOMPILE_XLA_CPU_OPTIMIZATION_LEVEL`` asks for."""
    environ = os.environ if environ is None else environ
    return _cpu_scheduler(client, environ) + _cpu_optimization_level(environ)


def _cpu_optimization_level(environ: dict[str, str]) -> list[tuple[str, object]]:
    raw = environ.get(CPU_OPTIMIZATION_LEVEL_VARIABLE, "").strip()
    if not raw:
        return []
    if raw not in ("0", "1", "2", "3"):
        raise ValueError(f"{CPU_OPTIMIZATION_LEVEL_VARIABLE} is an optimisation level from 0 to 3, not {raw!r}")
    return [("xla_backend_optimization_level", int(raw))]


def _cpu_scheduler(client: object, environ: dict[str, str]) -> list[tuple[str, object]]:
    if {name for name, _ in _flags_in(environ.get("XLA_FLAGS", ""))} & _USER_SCHEDULER_FLAGS:
        return []
    found = _cpu_overrides.get(id(client))
    if found is None:
        found = [(CPU_SCHEDULER_FLAG, CPU_SCHEDULER)]
        probe = jax_backend.get_compile_options(num_replicas=1, num_partitions=1)
        probe.env_option_overrides = found
        try:
            client.compile_and_load(_PROBE_MODULE, xla_client.DeviceList(tuple(client.devices()[:1])), probe)
        except xla_client.XlaRuntimeError as failure:
            if CPU_SCHEDULER_FLAG not in str(failure) and "compile option" not in str(failure):
                raise
            found = []
        _cpu_overrides[id(client)] = found
    return list(found)


# XLA flags and DebugOptions fields that only change what XLA writes or logs, never the code it generates.
_DEBUG_FLAG_PREFIXES = ("xla_dump", "xla_gpu_dump", "xla_log", "xla_detailed_logging", "xla_enable_dumping",
                        "xla_cpu_enable_xprof_traceme", "xla_hlo_graph", "xla_hlo_profile")

# Flags that only steer the runtime. jax appends --xla_tpu_use_enhanced_launch_barrier=true to LIBTPU_INIT_ARGS
# on every Cloud TPU VM, so keying on it would make a TPU host miss every entry compiled for it elsewhere.
_RUNTIME_ONLY_FLAGS = ("xla_tpu_use_enhanced_launch_barrier",)
_OTHER_PLATFORM_FLAGS = ("xla_cpu_", "xla_gpu_", "xla_force_host_platform_device_count")


def _is_debug_flag(name: str) -> bool:
    return name.startswith(_DEBUG_FLAG_PREFIXES)


def build_flags(environ: dict[str, str] | None = None, platform: str | None = None) -> list[str]:
    """The XLA flags (``XLA_FLAGS``, and ``LIBTPU_INIT_ARGS`` on TPU hosts) that can change generated code:
    dump and logging flags dropped, one value per flag (the last wins, as in XLA), sorted. For ``platform``
    "tpu", CPU and GPU flags are dropped too: a CI machine's CPU settings cannot change TPU code."""
    environ = os.environ if environ is None else environ
    foreign = _OTHER_PLATFORM_FLAGS if platform == "tpu" else ()
    flags: dict[str, str] = {}
    for variable in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        for name, flag in _flags_in(environ.get(variable, "")):
            if name and not _is_debug_flag(name) and name not in _RUNTIME_ONLY_FLAGS and not name.startswith(foreign):
                flags[name] = flag
    return [flags[name] for name in sorted(flags)]


def _flags_in(text: str) -> list[tuple[str, str]]:
    """(name, ``name=value`` without leading dashes) of each flag in an ``XLA_FLAGS``-style string."""
    flags = [token.lstrip("-") for token in shlex.split(text)]
    return [(flag.split("=", 1)[0], flag) for flag in flags]


def compile_options_fingerprint(options: object) -> bytes:
    """``options`` serialised with its debug fields (dump paths, logging) cleared: the bytes a cache key
    hashes, equal for two processes that compile the same code whatever they dump."""
    copy = type(options).ParseFromString(options.SerializeAsString())
    debug = copy.executable_build_options.debug_options
    for name in dir(debug):
        if _is_debug_flag(name):
            value = getattr(debug, name)
            setattr(debug, name, type(value)())
    return copy.SerializeAsString()


_BUILD_OPTION_FIELDS = ("num_replicas", "num_partitions", "use_spmd_partitioning", "use_shardy_partitioner",
                        "use_auto_spmd_partitioning", "optimization_level", "memory_fitting_level",
                        "exec_time_optimization_effort", "memory_fitting_effort", "device_assignment",
                        "result_layout")


def describe_compile_options(options: object) -> str:
    """``options`` as readable text (dumps): the options a compile used, with XLA's full debug options."""
    build = options.executable_build_options
    lines = [f"{name}: {getattr(options, name)!r}"
             for name in ("num_replicas", "num_partitions", "parameter_is_tupled_arguments", "profile_version")]
    lines.append(f"env_option_overrides: {sorted(options.env_option_overrides)!r}")
    lines.append("executable_build_options:")
    lines += [f"  {name}: {getattr(build, name, None)!r}" for name in _BUILD_OPTION_FIELDS]
    lines.append("debug_options:")
    debug = str(build.debug_options).splitlines()  # text format, after a "goo.gle/debugonly" marker line
    lines += [f"  {line.rstrip()}" for line in debug if line.strip() and not line.startswith("goo.gle")]
    return "\n".join(lines) + "\n"
