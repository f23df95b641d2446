"""What the compile path tells the rest of the process: one event per compile (observers: dumps, ``tpucompile
warm``, tests), each graph as it leaves every stage (the graph recorder of ``tpucompile.debug``), and counters
of graphs compiled and executables built."""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from tpucompile import artifacts
from tpucompile.cache import MemoryStore
from tpucompile.lowering import LoweredProgram
from tpucompile.metrics import compile_stats as stats


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    """What one compile of one graph specialisation produced; handed to every observer."""

    name: str
    graph: torch.fx.GraphModule | None
    """The ATen graph compiled; None when a warm start rebuilt it from a cached plan without AOTAutograd."""
    program: LoweredProgram
    key: str
    key_components: dict[str, Any]
    cache_hit: bool
    """True when the executable was not compiled now (found in memory, the local or the remote cache)."""
    compile_seconds: float
    """Time spent obtaining the executable: looking it up and loading it, or compiling it."""
    tier: str | None = None
    """Where the executable came from: "memory", "local", "remote", or None when it was compiled."""
    saved_seconds: float = 0.0
    """For a persistent-cache hit: the compile time recorded with the entry minus the time to load it."""
    program_tier: str | None = None
    """Where the lowered program came from (lowering skipped), or None when the graph was lowered now."""
    executable: Any = None
    """The loaded XLA executable (dumps read its optimised HLO); for a compile-only target, the unloaded one,
    when it was compiled in this process."""
    target: str | None = None
    """The compile-only target this compile was for (``tpu:v5e:2x2``); None for this process's own devices."""
    report: dict[str, Any] | None = None
    """For a compile-only target: bytes per chip by use (``memory``) and ``flops``."""
    error: str | None = None
    """For a compile-only target: why it could not compile the graph (the graph still runs here)."""
    out_of_memory: bool = False
    """For a compile-only target: the graph does not fit the target's memory."""

    def saved_for_backward(self) -> dict[str, int] | None:
        """For a backward graph, the bytes of what its forward saved for it: ``activations`` (values the
        forward computed, held between the two programs) and ``arguments`` (forward inputs such as weights,
        which exist anyway); None for other graphs or without the ATen graph."""
        if self.graph is None or not self.name.endswith("(backward)"):
            return None
        saved = {"activations": 0, "arguments": 0}
        for node in self.graph.graph.nodes:
            value = node.meta.get("val")
            if node.op != "placeholder" or not isinstance(value, torch.Tensor) or node.name.startswith("tangents"):
                continue
            kind = "arguments" if node.name.startswith("primals") else "activations"
            saved[kind] += value.numel() * value.element_size()
        return saved


Observer = Callable[[CompileEvent], None]
_observers: list[Observer] = []


def add_observer(observer: Observer) -> Callable[[], None]:
    """Call ``observer`` after every graph compile (dumps and tests use it); returns its remover."""
    _observers.append(observer)
    return lambda: _observers.remove(observer) if observer in _observers else None


def notify(
    name: str,
    gm: torch.fx.GraphModule | None,
    program: LoweredProgram,
    program_tier: str | None,
    obtained: artifacts.LoadedExecutable | artifacts.TargetOutcome,
) -> None:
    """Count one compile or cache hit (``stats``) and hand every observer its event, for this process's devices
    or a compile-only target."""
    if isinstance(obtained, artifacts.LoadedExecutable):
        stats.record_executable(name, obtained.tier)
    if not _observers:
        return
    for_target: dict[str, Any] = {}
    if isinstance(obtained, artifacts.TargetOutcome):
        error = obtained.error
        for_target = {"target": obtained.target, "report": obtained.report,
                      "error": str(error) if error is not None else None,
                      "out_of_memory": bool(getattr(error, "out_of_memory", False))}
    event = CompileEvent(
        name, gm, program, obtained.key, obtained.components, obtained.tier is not None, obtained.seconds,
        obtained.tier, obtained.saved_seconds, program_tier, obtained.executable, **for_target,
    )
    for observer in list(_observers):
        observer(event)


GraphRecorder = Callable[[str, str, torch.fx.GraphModule], None]
_graph_recorder: GraphRecorder | None = None


def set_graph_recorder(recorder: GraphRecorder | None) -> None:
    """Have ``recorder(name, stage, gm)`` see each graph as it leaves every stage before lowering
    (``tpucompile.debug.recorder`` sets it); None, the default, makes recording a no-op."""
    global _graph_recorder
    _graph_recorder = recorder


def recording() -> bool:
    """Whether a graph recorder is set (a dump is being written: compile-only executables are kept for it)."""
    return _graph_recorder is not None


def record_graph(name: str, stage: str, gm: torch.fx.GraphModule) -> None:
    """Show ``gm`` as it is after ``stage`` to the graph recorder, if one is set."""
    if _graph_recorder is not None:
        _graph_recorder(name, stage, gm)


_graphs_compiled = 0
_recent: collections.deque[weakref.ref] = collections.deque(maxlen=64)


def count_graph() -> None:
    """Count one ATen graph handed to the compile path, or rebuilt from a cached plan."""
    global _graphs_compiled
    _graphs_compiled += 1


def graphs_compiled() -> int:
    """How many ATen graphs this process has handed to tpucompile, or rebuilt from a cached plan without
    AOTAutograd (tests use it to prove the backend ran)."""
    return _graphs_compiled


def remember_executable(executable: Any) -> None:
    """Keep a weak reference to ``executable`` among the most recent ones."""
    _recent.append(weakref.ref(executable))


def recent_executables() -> list[Any]:
    """The executables built most recently in this process, oldest first (for benchmarks and debugging)."""
    return [e for e in (ref() for ref in _recent) if e is not None]


def executable_cache() -> MemoryStore[Any]:
    """The process-wide cache of loaded executables (content-addressed)."""
    return artifacts.executable_cache()
