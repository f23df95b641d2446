"""The device programs run on: a PJRT client from jax and the devices one executable uses."""

from __future__ import annotations

import dataclasses
import functools
import os
import shlex

import jax.extend.backend as jax_backend
import jaxlib
from jaxlib import xla_client

from tpucompile.errors import OptionsError


@dataclasses.dataclass(frozen=True)
class Target:
    """One PJRT client and the devices an executable is compiled for and run on."""

    client: object
    devices: tuple[object, ...]

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
            "jaxlib": jaxlib.__version__,
        }


@functools.cache
def get_target(platform: str | None = None) -> Target:
    """The first device of ``platform`` (jax's default backend when None)."""
    try:
        client = jax_backend.get_backend(platform)
    except RuntimeError as error:
        raise OptionsError(f"no PJRT backend for platform {platform!r}: {error}") from None
    return Target(client=client, devices=(client.local_devices()[0],))


_compile_options: dict[tuple[int, int], object] = {}


def compile_options(target: Target, num_partitions: int = 1) -> object:
    """XLA compile options for ``target`` (built once per target and partition count)."""
    key = (id(target.client), num_partitions)
    options = _compile_options.get(key)
    if options is None:
        options = jax_backend.get_compile_options(
            num_replicas=1, num_partitions=num_partitions, backend=target.client
        )
        _compile_options[key] = options
    return options


# XLA flags and DebugOptions fields that only change what XLA writes or logs, never the code it generates.
_DEBUG_FLAG_PREFIXES = ("xla_dump", "xla_gpu_dump", "xla_log", "xla_detailed_logging", "xla_enable_dumping",
                        "xla_cpu_enable_xprof_traceme", "xla_hlo_graph", "xla_hlo_profile")


def _is_debug_flag(name: str) -> bool:
    return name.startswith(_DEBUG_FLAG_PREFIXES)


def build_flags(environ: dict[str, str] | None = None) -> list[str]:
    """The XLA flags (``XLA_FLAGS``, and ``LIBTPU_INIT_ARGS`` on TPU hosts) that can change generated code:
    dump and logging flags dropped, one value per flag (the last wins, as in XLA), sorted."""
    environ = os.environ if environ is None else environ
    flags: dict[str, str] = {}
    for variable in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        for token in shlex.split(environ.get(variable, "")):
            name = token.lstrip("-").split("=", 1)[0]
            if name and not _is_debug_flag(name):
                flags[name] = token.lstrip("-")
    return [flags[name] for name in sorted(flags)]


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
    lines.append("executable_build_options:")
    lines += [f"  {name}: {getattr(build, name, None)!r}" for name in _BUILD_OPTION_FIELDS]
    lines.append("debug_options:")
    debug = str(build.debug_options).splitlines()  # text format, after a "goo.gle/debugonly" marker line
    lines += [f"  {line.rstrip()}" for line in debug if line.strip() and not line.startswith("goo.gle")]
    return "\n".join(lines) + "\n"
