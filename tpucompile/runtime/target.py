"""The device programs run on: a PJRT client from jax and the devices one executable uses."""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex

import jax.extend.backend as jax_backend
import jaxlib
import numpy as np
from jaxlib import xla_client

from tpucompile.errors import OptionsError, ShardingError
from tpucompile.runtime import host_blas, libtpu
from tpucompile.runtime.host_blas import HostBlas
from tpucompile.targets import describe_topology


@dataclasses.dataclass(frozen=True)
class Target:
    """One PJRT client and the devices an executable is compiled for and run on."""

    client: object
    devices: tuple[object, ...]
    name: str | None = None
    """The target's name (``tpu:v5e:2x2``) when it is compile-only; None for this process's own devices."""
    compile_only: bool = False
    """Executables are compiled for its devices and stored, never loaded or run here."""
    host_blas: HostBlas | None = None
    """The host BLAS kernels its programs' matrix products call (``host_blas``; one CPU device only); None
    leaves them to XLA's dot emitter."""

    @property
    def platform(self) -> str:
        return self.client.platform

    @property
    def device(self) -> object:
        return self.devices[0]

    def device_list(self) -> xla_client.DeviceList:
        return xla_client.DeviceList(self.devices)

    def describe(self) -> dict[str, object]:
        """What identifies the compiled code this target produces (part of every cache key)."""
        return {
            "platform": self.client.platform,
            "platform_version": self.client.platform_version,
            "device_kind": self.device.device_kind,
            "device_count": len(self.devices),
            "topology": topology(self.client),
            "jaxlib": jaxlib.__version__,
            "host_blas": self.host_blas.fingerprint if self.host_blas is not None else None,
        }


_topologies: dict[int, str] = {}


def topology(client: object) -> str:
    """The chips of ``client``'s slice along each axis (``2x2x1``), from its devices' coordinates, the same
    way on a real TPU host and for compile-only devices (``N devices`` where devices have no coordinates)."""
    text = _topologies.get(id(client))
    if text is None:
        devices = client.devices()
        coords = [tuple(d.coords) for d in devices if getattr(d, "coords", None) is not None]
        cores = max((int(getattr(d, "core_on_chip", 0) or 0) for d in devices), default=0) + 1
        text = _topologies[id(client)] = describe_topology(coords if len(coords) == len(devices) else [], cores,
                                                           len(devices))
    return text


@functools.cache
def get_target(platform: str | None = None) -> Target:
    """The first device of ``platform`` (jax's default backend when None)."""
    libtpu.allow_shared_load()
    if platform in (None, "cpu"):
        _skip_absent_tpu()
        _run_cpu_programs_inline()
    try:
        with libtpu.quiet():
            client = jax_backend.get_backend(platform)
    except RuntimeError as error:
        raise OptionsError(f"no PJRT backend for platform {platform!r}: {error}") from None
    kernels = host_blas.kernels() if client.platform == "cpu" else None
    return Target(client=client, devices=(client.local_devices()[0],), host_blas=kernels)


def _skip_absent_tpu() -> None:
    """On a CPU-only machine, start only jax's CPU backend, not libtpu's: with the ``tpu`` extra installed,
    jax would otherwise load libtpu in every process (about 175 MB of memory and a second of start-up) only
    to find no chip. Compile-only TPU topologies do not need that backend. Left alone when the user chose
    jax's platforms, when TPU chips may be present, when a GPU plugin is installed, or once jax has started."""
    import importlib.util

    import jax
    from jax._src import xla_bridge

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return
    if libtpu.installed_version() is None or libtpu.has_tpu_chips():
        return
    if any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                                                       "jax_plugins")):
        return
    jax.config.update("jax_platforms", "cpu")


def _run_cpu_programs_inline() -> None:
    """Run CPU programs in the calling thread rather than on jax's dispatch thread. tpucompile hands every
    result to torch at once, so asynchronous dispatch buys nothing and costs a thread wake-up per call: an
    x + 1 on 64x256 floats executes in ~9 us inline against ~70 us dispatched, once the worker has gone idle
    between calls (as it does between steps). Inline, the host BLAS also runs on torch's own thread and
    shares its OpenMP workers instead of starting a second team. Left alone once jax's backends have started."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_cpu_enable_async_dispatch", False)


def get_mesh_target(platform: str | None, size: int, device_ids: tuple[int, ...] | None = None) -> Target:
    """The ``size`` devices of a mesh, in mesh order: ``device_ids``, or the platform's first ``size`` devices
    (of every process, in id order)."""
    client = get_target(platform).client
    devices = sorted(client.devices(), key=lambda d: d.id)
    if device_ids is None:
        if size > len(devices):
            hint = (f"; for virtual CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count={size} "
                    "before jax starts" if client.platform == "cpu" else "")
            raise ShardingError(f"the mesh needs {size} devices but the {client.platform} platform has "
                                f"{len(devices)}{hint}")
        return _mesh_target(client, tuple(devices[:size]))
    by_id = {d.id: d for d in devices}
    missing = [i for i in device_ids if i not in by_id]
    if missing:
        raise ShardingError(f"the mesh names device ids {missing}, which the {client.platform} platform lacks "
                            f"(it has {sorted(by_id)})")
    return _mesh_target(client, tuple(by_id[i] for i in device_ids))


@functools.cache
def _mesh_target(client: object, devices: tuple[object, ...]) -> Target:
    return Target(client=client, devices=devices)


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
buffers, which chains the thunks so that few are ready together (DLRM's inference program: 11 source thunks
-> 3, its step 0.25 -> 0.12 ms; docs/benchmarks.md has every model)."""

_USER_SCHEDULER_FLAGS = {CPU_SCHEDULER_FLAG, "xla_cpu_enable_concurrency_optimized_scheduler"}
_PROBE_MODULE = "func.func public @main(%x: tensor<f32>) -> tensor<f32> { return %x : tensor<f32> }"
_cpu_overrides: dict[int, list[tuple[str, object]]] = {}


def cpu_option_overrides(client: object, environ: dict[str, str] | None = None) -> list[tuple[str, object]]:
    """The XLA options tpucompile sets for compiles on ``client`` (a CPU client): none when ``XLA_FLAGS``
    chooses a scheduler itself, or when this jaxlib's XLA does not know the option (checked once per client
    with a one-instruction compile, which fails on the option before compiling anything)."""
    environ = os.environ if environ is None else environ
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
