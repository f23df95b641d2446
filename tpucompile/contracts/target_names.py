"""Compile target names (``cpu``, ``cuda``, ``tpu``, ``tpu:v5e:2x2``) and the TPU generations tpucompile can
compile for on a machine without a TPU.

A name with a topology (``tpu:v5e:2x2``: a v5e slice of 2 by 2 chips) asks for a compile-only target: libtpu
describes the devices of that slice on any machine, and XLA compiles for them without running anything. A
bare platform (``cpu``, ``cuda``, ``tpu``) means that platform's devices on this machine.

Pure Python without jax, so that options, the command line and ``tpucompile cache ls`` read names quickly.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from tpucompile.errors import OptionsError


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation as libtpu names it, and what a chip of it holds."""

    name: str
    device_kind: str
    """``device_kind`` of its devices: one of the executable key's components."""
    dims: int
    """How many axes its topology names have (2 for the "lite" chips, 3 for the others)."""
    hbm_bytes: int
    """HBM one chip offers a program, as XLA's TPU compiler counts it when it refuses one that does not fit."""
    host_chips: int
    """Chips on one host of the largest single-host slice (slices up to this size are one host)."""
    peak_bf16_flops: float
    """Peak bfloat16 matrix throughput of one chip (the vendor's published figure), for MFU estimates."""
    hbm_bytes_per_second: float
    """HBM bandwidth of one chip (the vendor's published figure), for roofline time estimates."""
    clock_hz: float
    """Core clock, to turn the compiler's cycle estimates into seconds: the peak rate over what the chip's
    matrix units do per cycle (v5e: 4 units of 128 x 128 multiply-adds; v5p: 8; v6e: 4 of 256 x 256)."""


_GIB = 2**30
GENERATIONS = {
    "v5e": Generation("v5e", "TPU v5 lite", 2, int(15.75 * _GIB), 8, 197e12, 819e9, 197e12 / (4 * 128 * 128 * 2)),
    "v6e": Generation("v6e", "TPU v6 lite", 2, int(31.25 * _GIB), 8, 918e12, 1640e9, 918e12 / (4 * 256 * 256 * 2)),
    "v5p": Generation("v5p", "TPU v5", 3, int(95.74 * _GIB), 4, 459e12, 2765e9, 459e12 / (8 * 128 * 128 * 2)),
}
"""Generations whose compile-only devices are laid out as a real host of theirs sees them (one device per
chip). libtpu describes older and newer ones too, but with a device per core, which a real host of theirs
need not show, so entries built for them could never be hit."""



def generation_of(device_kind: Any) -> Generation | None:
    """The generation whose devices report ``device_kind`` (``"TPU v5 lite"``), or None for one not listed."""
    return next((g for g in GENERATIONS.values() if g.device_kind == device_kind), None)


VALID_FORMS = ("tpu:v5e:AxB, tpu:v6e:AxB or tpu:v5p:AxBxC (chips along each axis, e.g. tpu:v5e:2x2, "
               "tpu:v5e:4x4, tpu:v6e:2x4, tpu:v5p:2x2x1), or a platform of this machine: cpu, cuda, tpu")

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_SHAPE = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*)*$")


@dataclasses.dataclass(frozen=True)
class TargetName:
    """A parsed target name."""

    platform: str
    generation: str | None = None
    shape: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.generation is None:
            return self.platform
        return f"{self.platform}:{self.generation}:{'x'.join(map(str, self.shape))}"

    @property
    def compile_only(self) -> bool:
        """Whether the name describes devices by topology (compiled for, never run on, here)."""
        return self.generation is not None

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def bounds(self) -> tuple[int, int, int]:
        """The slice's chips along three axes, as device coordinates span them."""
        padded = (*self.shape, 1, 1, 1)
        return (padded[0], padded[1], padded[2])

    @property
    def topology(self) -> str:
        """The ``topology`` key component a host of this slice has (see ``describe_topology``)."""
        return "x".join(map(str, self.bounds))


def parse(text: str) -> TargetName:
    """``text`` as a target name; ``OptionsError`` listing the valid forms when it is none."""
    parts = text.strip().lower().split(":")
    platform = parts[0]
    if platform not in PLATFORMS or len(parts) not in (1, 3) or (len(parts) == 3 and platform != "tpu"):
        raise OptionsError(f"unknown compile target {text!r}; valid targets are {VALID_FORMS}")
    if len(parts) == 1:
        return TargetName(platform)
    generation, shape = parts[1], parts[2]
    if generation not in GENERATIONS:
        raise OptionsError(f"unknown TPU generation {generation!r} in {text!r}; valid targets are {VALID_FORMS}")
    dims = GENERATIONS[generation].dims
    sizes = tuple(int(s) for s in shape.split("x")) if _SHAPE.match(shape) else ()
    if len(sizes) != dims:
        raise OptionsError(f"{text!r}: a {generation} topology has {dims} axes of chips ("
                           f"{'AxB' if dims == 2 else 'AxBxC'}); valid targets are {VALID_FORMS}")
    return TargetName(platform, generation, sizes)


def describe_topology(coords: list[tuple[int, ...]], cores_per_chip: int, device_count: int) -> str:
    """The ``topology`` key component: the chips along each axis (``2x2x1``), with the cores of a chip when
    it shows more than one device; ``N devices`` for devices without coordinates (CPU, GPU).

    Computed from the devices alone, the same way for a real host and for libtpu's compile-only devices."""
    if not coords:
        return f"{device_count} device{'s' if device_count != 1 else ''}"
    axes = max(len(c) for c in coords)
    bounds = [max(c[axis] for c in coords if len(c) > axis) + 1 for axis in range(axes)]
    text = "x".join(str(b) for b in (*bounds, 1, 1, 1)[: max(3, axes)])
    return text + (f" ({cores_per_chip} cores per chip)" if cores_per_chip > 1 else "")


def label(components: Mapping[str, Any]) -> str:
    """The target an entry was built for, from its key components: ``tpu:v5e:2x2``, ``cpu``; ``-`` when the
    entry names no platform."""
    platform = components.get("platform")
    if not isinstance(platform, str):
        return "-"
    if platform != "tpu":
        return platform
    kind, topology = components.get("device_kind"), components.get("topology")
    generation = generation_of(kind)
    if generation is None or not isinstance(topology, str) or not re.match(r"^\d+x\d+x\d+$", topology):
        return f"tpu ({kind}{', ' + topology if isinstance(topology, str) else ''})"
    sizes = topology.split("x")
    if generation.dims == 2 and sizes[2] == "1":
        sizes = sizes[:2]
    return f"tpu:{generation.name}:{'x'.join(sizes)}"


def slug(name: str) -> str:
    """A target name as a file name: ``tpu-v5e-2x2``."""
    return re.sub(r"[^a-z0-9x]+", "-", name.lower()).strip("-")
