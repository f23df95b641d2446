"""The device programs run on: a PJRT client from jax and the devices one executable uses."""

from __future__ import annotations

import dataclasses
import functools

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
