"""``Target``, the devices a program is compiled for, and this process's own: a PJRT client and the devices one
executable uses (one device, or the devices of a mesh). The CPU of a single process gets a client of
tpucompile's own, so that compiling never changes the user's jax settings; other platforms use jax's."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax.extend.backend as jax_backend
import jaxlib
from jaxlib import xla_client

from tpucompile.contracts.target_names import describe_topology
from tpucompile.errors import OptionsError, ShardingError
from tpucompile.runtime.host_kernels.library import HostBlas
from tpucompile.runtime.host_kernels.library import kernels as host_kernels
from tpucompile.runtime.targets import libtpu


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


def get_target(platform: str | None = None) -> Target:
    """The first device of ``platform`` (jax's default backend when None; CPU on a machine with no TPU chip
    and no GPU plugin, without starting jax's backends)."""
    if platform is None:
        platform = _default_platform()
    if platform == "cpu" and not _distributed():
        return _own_cpu_target()
    return _jax_target(platform)


@functools.cache
def _jax_target(platform: str | None) -> Target:
    """The first device of jax's own client for ``platform``: accelerators, and the CPU of a run of several
    processes (``jax.distributed`` joins jax's client to the others)."""
    libtpu.allow_shared_load()
    try:
        with libtpu.quiet():
            client = jax_backend.get_backend(platform)
    except RuntimeError as error:
        raise OptionsError(f"no PJRT backend for platform {platform!r}: {error}") from None
    kernels = host_kernels() if client.platform == "cpu" else None
    return Target(client=client, devices=(client.local_devices()[0],), host_blas=kernels)


_inline_clients: set[int] = set()


@functools.cache
def _own_cpu_target() -> Target:
    """This process's CPU through a PJRT client of tpucompile's own, not jax's, so that nothing tpucompile
    needs of it changes the user's jax: jax's CPU client and its settings stay as the user left them, and
    jax's other backends (libtpu's, which loads about 175 MB and takes a second to find no chip) are not
    started. Its programs run in the calling thread (``asynchronous=False``): tpucompile hands every result
    to torch at once, so a dispatch thread buys nothing and costs a thread wake-up per call, which dominates
    small programs once the worker has gone idle between calls (as it does between steps); inline, the host
    BLAS also runs on torch's own thread and shares its OpenMP workers instead of starting a second team.
    The device count follows jax's ``jax_num_cpu_devices`` when set, else ``XLA_FLAGS``'
    ``--xla_force_host_platform_device_count``, as jax's CPU client does."""
    import jax

    count = jax.config.values.get("jax_num_cpu_devices", -1)
    try:
        client = xla_client.make_cpu_client(asynchronous=False, num_devices=count if count >= 0 else None)
    except RuntimeError as error:
        raise OptionsError(f"no PJRT client for the CPU: {error}") from None
    _inline_clients.add(id(client))
    return Target(client=client, devices=(client.local_devices()[0],), host_blas=host_kernels())


def runs_inline(client: object) -> bool:
    """Whether ``client``'s programs run in the calling thread (each call has finished reading its inputs when
    it returns): tpucompile's own CPU client; jax's CPU client only when the user turned off jax's
    ``jax_cpu_enable_async_dispatch``."""
    if id(client) in _inline_clients:
        return True
    import jax

    return client.platform == "cpu" and not jax.config.values.get("jax_cpu_enable_async_dispatch", True)


def _default_platform() -> str | None:
    """The platform a target of no named platform runs on: jax's default backend once jax has started; the
    first of the platforms the user chose for jax (None, jax's default, unless it is ``cpu``); ``cpu`` on a
    machine where jax could find nothing else (no TPU chip, no GPU plugin), found without starting jax;
    None (jax's default backend, starting it) otherwise."""
    import importlib.util

    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return jax.default_backend()
    chosen = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
    if chosen:
        return "cpu" if chosen.split(",")[0].strip() == "cpu" else None
    if libtpu.installed_version() is not None and libtpu.has_tpu_chips():
        return None
    if any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                                                       "jax_plugins")):
        return None
    return "cpu"


def _distributed() -> bool:
    """Whether this process is one of several joined by ``jax.distributed`` (their CPUs share jax's client)."""
    from jax._src import distributed

    return distributed.global_state.client is not None


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
