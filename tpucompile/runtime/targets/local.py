"""``Target``, the devices a program is compiled for, and this process's own: a PJRT client from jax and the
devices one executable uses (one device, or the devices of a mesh)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax.extend.backend as jax_backend
import jaxlib
from jaxlib import xla_client

from tpucompile.errors import OptionsError, ShardingError
from tpucompile.runtime.host_kernels.library import HostBlas
from tpucompile.runtime.host_kernels.library import kernels as host_kernels
from tpucompile.runtime.targets import libtpu
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
    """The host kernels its programs' matrix products and convolutions call (``host_kernels``; one CPU device
    only); None leaves them to XLA's own dots and convolutions."""

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
    kernels = host_kernels() if client.platform == "cpu" else None
    return Target(client=client, devices=(client.local_devices()[0],), host_blas=kernels)


def _skip_absent_tpu() -> None:
    """On a CPU-only machine, start only jax's CPU backend, not libtpu's: with the ``tpu`` extra installed,
    jax would otherwise load libtpu in every process (memory and start-up time) only to find no chip.
    Compile-only TPU topologies do not need that backend. Left alone when the user chose jax's platforms,
    when TPU chips may be present, when a GPU plugin is installed, or once jax has started."""
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
    result to torch at once, so asynchronous dispatch buys nothing and costs a thread wake-up per call, which
    dominates small programs once the worker has gone idle between calls (as it does between steps). Inline,
    the host BLAS also runs on torch's own thread and shares its OpenMP workers instead of starting a second
    team. Left alone once jax's backends have started."""
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
