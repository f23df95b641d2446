"""The compile path of one ATen graph: passes → lowering → cache → runtime, handing back the callable that
runs it.

Its rooms: ``resolved_targets`` (the devices a compile is for, resolved once at the backend's entry),
``graphs`` (the entry: passes, then one program or compiled regions), ``eager_fallback`` (regions with eager ops
between them), ``shape_dispatch`` (static, per-bucket or per-shape executables), ``executable_assembly``
(loaded for this process, compiled for compile-only targets) and ``events`` (observers, the graph recorder,
counters).
"""

from tpucompile.driver.events import (
    CompileEvent,
    add_observer,
    executable_cache,
    graphs_compiled,
    recent_executables,
    record_graph,
    set_graph_recorder,
)
from tpucompile.driver.executable_assembly import load_compiled_graph
from tpucompile.driver.graphs import compile_graph
from tpucompile.driver.resolved_targets import (
    CompileTargets,
    custom_ops_lowered_whole,
    decompositions_for,
    resolve_targets,
)

__all__ = [
    "CompileEvent",
    "CompileTargets",
    "add_observer",
    "compile_graph",
    "custom_ops_lowered_whole",
    "decompositions_for",
    "executable_cache",
    "graphs_compiled",
    "load_compiled_graph",
    "recent_executables",
    "record_graph",
    "resolve_targets",
    "set_graph_recorder",
]
