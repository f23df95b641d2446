"""Compile-only targets: the devices of a TPU slice that is not here, described by libtpu on any machine.

``compile_only_target("tpu:v5e:2x2")`` is a ``Target`` whose client can compile for a v5e slice of 2 by 2 chips
but not run anything. Its key components are the ones a host of that slice computes for itself: platform
``tpu``, the platform version libtpu reports (which names the chip and the libtpu build), the chip's device
kind, the device count of the executable and the slice's topology from the devices' coordinates. An unsharded
program uses the slice's first device, as the run-time path on a real host does.
"""

from __future__ import annotations

import dataclasses
import functools

from tpucompile.contracts import target_names
from tpucompile.errors import OptionsError
from tpucompile.runtime.targets import libtpu
from tpucompile.runtime.targets.local import Target, get_target


@functools.cache
def compile_only_target(name: str) -> Target:
    """The compile-only target ``name`` names (``tpu:v5e:2x2``); ``OptionsError`` saying what to install or
    which names are valid when it cannot be had."""
    parsed = target_names.parse(name)
    if not parsed.compile_only:
        raise OptionsError(f"{name!r} names no topology; compile-only targets look like {target_names.VALID_FORMS}")
    libtpu.check_installed(str(parsed))
    libtpu.allow_shared_load()
    from jax.experimental import topologies

    generation = target_names.GENERATIONS[parsed.generation]
    extra = {}
    if parsed.chips <= generation.host_chips:  # one host holds the whole slice, as on a real one
        extra["chips_per_host_bounds"] = parsed.bounds
    try:
        with libtpu.quiet():
            devices = topologies.get_topology_desc(f"{parsed.generation}:{parsed.topology}", "tpu", **extra).devices
    except Exception as error:
        raise OptionsError(f"libtpu has no topology {str(parsed)!r} ({_first_line(error)}); valid targets are "
                           f"{target_names.VALID_FORMS}") from None
    devices = sorted(devices, key=lambda d: d.id)
    return Target(client=devices[0].client, devices=(devices[0],), name=str(parsed), compile_only=True)


def spanning(target: Target, size: int) -> Target:
    """``target`` widened to the first ``size`` devices of its slice (in id order, as a mesh of that size takes
    them on a real host): the devices a program partitioned ``size`` ways is compiled for."""
    if size == len(target.devices) or not target.compile_only:
        return target
    devices = sorted(target.client.devices(), key=lambda d: d.id)
    if size > len(devices):
        raise OptionsError(f"the program is partitioned over {size} devices, but {target.name} has {len(devices)}")
    return dataclasses.replace(target, devices=tuple(devices[:size]))


def compile_targets(names: tuple[str, ...], platform: str | None = None) -> tuple[Target, ...]:
    """The extra targets ``names`` ask for besides this process's own devices (``platform``): compile-only
    topologies, and other local platforms; a name for the run target itself is dropped."""
    run = get_target(platform)
    chosen: dict[str, Target] = {}
    for name in names:
        parsed = target_names.parse(name)
        if parsed.compile_only:
            target = compile_only_target(str(parsed))
        elif parsed.platform == run.platform:
            continue
        else:
            try:
                local = get_target(parsed.platform)
            except OptionsError as error:
                raise OptionsError(f"target {parsed.platform!r} is a platform of this machine, and this machine has "
                                   f"none ({error}); only TPU slices compile without their devices: "
                                   f"{target_names.VALID_FORMS}") from None
            target = dataclasses.replace(local, name=parsed.platform, compile_only=True)
        chosen.setdefault(str(target.name), target)
    return tuple(chosen.values())


def hbm_bytes(target: Target) -> int | None:
    """HBM per chip of ``target``'s devices (None for a device tpucompile knows no figure for)."""
    generation = target_names.generation_of(target.device.device_kind)
    return generation.hbm_bytes if generation else None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
