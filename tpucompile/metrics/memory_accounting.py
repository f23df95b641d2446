"""Bytes of device buffers tpucompile holds, by use and device, and each compiled graph's memory needs: the
figures behind ``tpucompile.memory_stats()``.

Counters move where buffers are taken and let go, never by walking them: the runtime calls ``hold`` when it
keeps a buffer (an argument it imported, a result it returned as a tensor or kept for a backward), and a weak
reference's callback takes the bytes off when the object dies (``release`` when a program takes a buffer over).
A buffer whose memory is a torch tensor's (an import without a copy, the CPU's DLPack exchange) counts as held
and as *shared*: torch's own figures count those bytes too. Programs' figures (XLA's analysis of each loaded
executable) are read when asked for, from the executables still alive.

A leaf module (standard library only): the runtime and the driver report to it, the package root reads it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

PARAMETERS = "parameters"
"""Buffers imported from ``nn.Parameter`` tensors, kept for the next call."""
INPUTS = "inputs"
"""Buffers imported from other tensors (the batch, buffers, optimiser state, incoming gradients)."""
CONSTANTS = "constants"
"""Buffers of the large constants a compiled graph passes to its program (lifted out of the program text)."""
SAVED_ACTIVATIONS = "saved_activations"
"""Values a forward program computed and the runtime keeps as device buffers until the backward reads them."""
OUTPUTS = "outputs"
"""Program results handed to torch as tensors, for as long as their storage lives (whatever tensor holds it)."""
USES = (PARAMETERS, INPUTS, CONSTANTS, SAVED_ACTIVATIONS, OUTPUTS)


def argument_use(constant: bool, parameter: bool) -> str:
    """The use a program argument's imported buffer counts as: a graph's lifted constant, an
    ``nn.Parameter``'s value, or any other input."""
    return CONSTANTS if constant else PARAMETERS if parameter else INPUTS

_TORCH_PLATFORMS = {"cuda": "gpu"}
"""Torch's device type names that jax spells otherwise."""


class _Counts:
    """Bytes held by use, the part of them shared with torch, and the high-water marks since the last reset."""

    def __init__(self) -> None:
        self.held = dict.fromkeys(USES, 0)
        self.shared = dict.fromkeys(USES, 0)
        self.total = 0
        self.own = 0
        self.peak_total = 0
        self.peak_own = 0

    def reset_peak(self) -> None:
        self.peak_total = self.total
        self.peak_own = self.own


_ALL = _Counts()
"""Every device together (its peak is the peak of the sum, not the sum of the devices' peaks)."""


class _Hold(weakref.ref):
    """A held object's weak reference, carrying what to take off when the object dies."""

    __slots__ = ("key", "memory", "nbytes", "shared", "use")


_live: dict[int, _Hold] = {}
"""id(object) → its hold, for every object whose bytes are counted now."""


def _died(hold: _Hold) -> None:
    if _live.get(hold.key) is not hold:
        return
    del _live[hold.key]
    use, nbytes = hold.use, hold.nbytes
    for counts in hold.memory.chain:
        counts.held[use] -= nbytes
        counts.total -= nbytes
        if hold.shared:
            counts.shared[use] -= nbytes
        else:
            counts.own -= nbytes


class DeviceMemory(_Counts):
    """The counts of one device; the runtime keeps one per executable and reports to it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.chain = (self, _ALL)
        """What a buffer held here counts in: this device, and every device together."""

    def hold(self, value: Any, use: str, nbytes: int, shared: bool = False) -> None:
        """Count ``nbytes`` of ``use`` until ``value`` (a buffer or a storage, weakly referenced) dies."""
        key = id(value)
        if key in _live:
            return
        hold = _Hold(value, _died)
        hold.key, hold.memory, hold.use, hold.nbytes, hold.shared = key, self, use, nbytes, shared
        _live[key] = hold
        for counts in self.chain:  # written out here, not in a method: this runs for every buffer made
            counts.held[use] += nbytes
            counts.total += nbytes
            if shared:
                counts.shared[use] += nbytes
            else:
                counts.own += nbytes
                if counts.own > counts.peak_own:
                    counts.peak_own = counts.own
            if counts.total > counts.peak_total:
                counts.peak_total = counts.total


def release(value: Any) -> None:
    """Stop counting ``value`` before it dies (a program took the buffer over)."""
    hold = _live.get(id(value))
    if hold is not None and hold() is value:
        _died(hold)


_devices: dict[str, DeviceMemory] = {}


def device_name(device: Any) -> str:
    """A jax device as ``platform:id`` (``cpu:0``, ``tpu:3``)."""
    return f"{device.platform}:{device.id}"


def device_memory(device: Any) -> DeviceMemory:
    """The counts of ``device`` (a jax device), made on first use."""
    name = device_name(device)
    found = _devices.get(name)
    if found is None:
        found = _devices.setdefault(name, DeviceMemory(name))
    return found


# -- per compiled graph --------------------------------------------------------------------------------------

_programs: list[tuple[str, weakref.ref, tuple[str, ...], list[dict[str, int] | None]]] = []
"""(graph name, weak reference to the runtime's executable, its devices, its figures once read)."""

_FIGURES = (("arguments", "argument"), ("outputs", "output"), ("aliased", "alias"), ("temporaries", "temp"),
            ("generated_code", "generated_code"))
"""Our names for the fields of XLA's ``CompiledMemoryStats`` (``<field>_size_in_bytes``)."""


def record_program(name: str, executable: Any, devices: Iterable[Any]) -> None:
    """Note that graph ``name`` runs ``executable`` (which has ``loaded``, an XLA loaded executable) on
    ``devices``, for as long as it lives."""
    _programs[:] = [entry for entry in _programs if entry[1]() is not None]
    _programs.append((name, weakref.ref(executable), tuple(device_name(d) for d in devices), [None]))


def _program_figures(loaded: Any) -> dict[str, int]:
    """XLA's memory analysis of one loaded executable, in bytes per device."""
    stats = loaded.get_compiled_memory_stats()
    return {ours: int(getattr(stats, f"{theirs}_size_in_bytes")) for ours, theirs in _FIGURES}


def _graph_figures(selected: set[str] | None) -> dict[str, dict[str, int]]:
    """Per graph name, the largest of each figure over its live executables on the selected devices (a graph
    compiled per size or bucket runs one of them at a time), and how many there are."""
    graphs: dict[str, dict[str, int]] = {}
    for name, ref, devices, memo in list(_programs):
        executable = ref()
        if executable is None or (selected is not None and not selected.intersection(devices)):
            continue
        if memo[0] is None:
            memo[0] = _program_figures(executable.loaded)
        figures = graphs.setdefault(name, {"executables": 0, **{ours: 0 for ours, _ in _FIGURES}})
        figures["executables"] += 1
        for key, value in memo[0].items():
            figures[key] = max(figures[key], value)
    return graphs


# -- reading -------------------------------------------------------------------------------------------------


def _selected(device: Any) -> tuple[str, set[str] | None]:
    """The name of the selection and the device names in it (None: every device)."""
    if device is None:
        return "all", None
    if isinstance(device, int) and not isinstance(device, bool):
        platforms = sorted({name.split(":")[0] for name in _devices if name.endswith(f":{device}")})
        if len(platforms) > 1:
            raise ValueError(f"device {device} is ambiguous: tpucompile runs on {', '.join(platforms)} devices; "
                             f"name one, e.g. {platforms[0]}:{device}")
        label = f"{platforms[0]}:{device}" if platforms else str(device)
        return label, {label}
    if hasattr(device, "platform") and hasattr(device, "id"):  # a jax device
        label = device_name(device)
        return label, {label}
    text = str(device)  # a torch.device or a string
    platform, _, index = text.partition(":")
    platform = _TORCH_PLATFORMS.get(platform, platform)
    if not platform or (index and not index.isdigit()):
        raise ValueError(f"not a device: {device!r} (give a jax device, an index, or a name such as 'cpu:0')")
    if index:
        label = f"{platform}:{int(index)}"
        return label, {label}
    return platform, {name for name in _devices if name.split(":")[0] == platform}


def snapshot(device: Any = None) -> dict[str, Any]:
    """Bytes held now by use (``held``) and the part of them shared with torch (``shared``), the bytes of
    tpucompile's own (``own``: held but not shared), the high-water marks of both since the last reset
    (``peak``), and per compiled graph XLA's figures for its program (``graphs``), on ``device`` or on all."""
    label, selected = _selected(device)
    if selected is None:
        chosen: list[_Counts] = [_ALL]
    else:
        chosen = [_devices[name] for name in sorted(selected) if name in _devices]
    held = {use: sum(c.held[use] for c in chosen) for use in USES}
    shared = {use: sum(c.shared[use] for c in chosen) for use in USES}
    held["total"] = sum(held.values())
    shared["total"] = sum(shared.values())
    if len(chosen) == 1:
        peak = {"held": chosen[0].peak_total, "own": chosen[0].peak_own}
    else:  # several devices of one platform: the sum of their peaks bounds the peak of their sum
        peak = {"held": sum(c.peak_total for c in chosen), "own": sum(c.peak_own for c in chosen)}
    return {"device": label, "held": held, "shared": shared, "own": held["total"] - shared["total"],
            "peak": peak, "graphs": _graph_figures(selected)}


def reset_peak(device: Any = None) -> None:
    """Start the high-water marks again from what is held now, on ``device`` or on all."""
    _, selected = _selected(device)
    if selected is None:
        _ALL.reset_peak()
        for counts in list(_devices.values()):
            counts.reset_peak()
        return
    for name in selected:
        if name in _devices:
            _devices[name].reset_peak()
