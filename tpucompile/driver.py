"""Compile one ATen graph: passes → lowering → cache → runtime, and hand back the callable that runs it.

A graph with only static sizes is lowered and compiled at once. A graph with symbolic sizes is compiled
lazily, once per concrete set of sizes seen at call time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from tpucompile import artifacts, diagnostics
from tpucompile.cache import MemoryStore
from tpucompile.config import Options
from tpucompile.contracts import target_names
from tpucompile.contracts.size_expressions import runtime_symbols
from tpucompile.errors import CompileError, LoweringError, TpuCompileError, TpuCompileWarning, UnsupportedOpError
from tpucompile.frontend.traced_implementations import custom_op_overloads
from tpucompile.lowering import LoweredProgram, ShapeBindings, custom_ops, is_symbolic, jax_bridge, padding_safety
from tpucompile.lowering.graph import has_data_dependent_size, unsupported_reason
from tpucompile.lowering.registry import lookup_rule
from tpucompile.lowering.shardy_attributes import program_shardings
from tpucompile.metrics import compile_stats as stats
from tpucompile.metrics import memory_accounting
from tpucompile.passes import isolate_node, partition_supported, run_passes, saved_value_mismatch
from tpucompile.runtime import (
    GraphExecutable,
    ShapeOnlyExecutable,
    ShapeSpecializer,
    ShardedExecutable,
    get_mesh_target,
    get_target,
    process_count,
)
from tpucompile.runtime.buckets import BucketedGraph
from tpucompile.runtime.host_memory import release_free_memory
from tpucompile.runtime.input_views import input_views
from tpucompile.runtime.targets.compile_only import compile_targets, spanning
from tpucompile.sharding.annotate import record_layouts
from tpucompile.sharding.plan import Dims

log = logging.getLogger("tpucompile")


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


GraphRecorder = Callable[[str, str, torch.fx.GraphModule], None]
_graph_recorder: GraphRecorder | None = None


def set_graph_recorder(recorder: GraphRecorder | None) -> None:
    """Have ``recorder(name, stage, gm)`` see each graph as it leaves every stage before lowering
    (``tpucompile.debug.recorder`` sets it); None, the default, makes recording a no-op."""
    global _graph_recorder
    _graph_recorder = recorder


def record_graph(name: str, stage: str, gm: torch.fx.GraphModule) -> None:
    """Show ``gm`` as it is after ``stage`` to the graph recorder, if one is set."""
    if _graph_recorder is not None:
        _graph_recorder(name, stage, gm)


_graphs_compiled = 0
_recent: collections.deque[weakref.ref] = collections.deque(maxlen=64)


def recent_executables() -> list[GraphExecutable]:
    """The executables built most recently in this process, oldest first (for benchmarks and debugging)."""
    return [e for e in (ref() for ref in _recent) if e is not None]


def graphs_compiled() -> int:
    """How many ATen graphs this process has handed to tpucompile, or rebuilt from a cached plan without
    AOTAutograd (tests use it to prove the backend ran)."""
    return _graphs_compiled


def executable_cache() -> MemoryStore[Any]:
    """The process-wide cache of loaded executables (content-addressed)."""
    return artifacts.executable_cache()


def compile_graph(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Options, name: str
) -> Callable[[list[Any]], list[Any]]:
    """The boxed callable that runs ``gm`` (a functional ATen graph from AOTAutograd) on XLA.

    Ops tpucompile cannot lower either fail the compile (``fallback="error"``) or run in eager PyTorch
    between compiled regions (``fallback="eager"``, the default). Ops whose result size depends on the data
    (``nonzero``, ``unique``) are compiled as regions of their own, whose padded results are cut to size on
    the host before the next region sees them.
    """
    with (jax_bridge.target_platform(_target(options).platform),  # which custom ops have a JAX lowering here
          jax_bridge.kernels_interpreted(options.attention == "interpret")):
        return _compile_graph(gm, options, name)


def _compile_graph(gm: torch.fx.GraphModule, options: Options, name: str) -> Callable[[list[Any]], list[Any]]:
    global _graphs_compiled
    _graphs_compiled += 1
    record_graph(name, "aot_autograd", gm)
    after_pass = functools.partial(record_graph, name) if _graph_recorder is not None else None
    passes = run_passes(gm, options.embed_constant_limit, after_pass, options.mesh, options.shard,
                         process_count() if options.mesh is not None else 1)
    unsupported = [n for n in gm.graph.nodes if unsupported_reason(n) is not None]
    data_dependent = [n for n in gm.graph.nodes if has_data_dependent_size(n)]
    if not unsupported and not data_dependent:
        return _compile_region(gm, options, name, passes.lifted_constants)
    if options.mesh is not None:
        node = (unsupported or data_dependent)[0]
        raise UnsupportedOpError(f"a sharded graph compiles as one program, and this one cannot: "
                                 f"{unsupported_reason(node) or diagnostics.describe_node(node)} has "
                                 f"{'no lowering' if unsupported else 'a data-dependent result size'}")
    if unsupported and options.fallback == "error":
        raise UnsupportedOpError(unsupported_reason(unsupported[0]) + _FALLBACK_HINT)
    for node in unsupported:
        mismatch = saved_value_mismatch(node)
        if mismatch is not None:
            raise UnsupportedOpError(f"{diagnostics.describe_node(node)} would run in eager PyTorch on values its "
                                     f"fused forward did not save for it: {mismatch}")
    _warn_fallback(unsupported)
    regions = partition_supported(
        gm, lambda node: unsupported_reason(node) is None and not has_data_dependent_size(node)
    )
    data_dependent = [n for n in gm.graph.nodes if has_data_dependent_size(n)]  # the partitioner made new nodes
    for index, node in enumerate(data_dependent):
        region = f"data_dependent_{index}"
        isolate_node(gm, node, region)
        regions.append(region)
    record_graph(name, "partitioned", gm)
    for region in regions:
        submodule = getattr(gm, region)
        compiled = _compile_region(submodule, options, f"{name} {region}", [])
        setattr(gm, region, _CompiledRegion(compiled, _returns_tuple(submodule)))
    gm.recompile()
    return _EagerGraph(gm, passes.lifted_constants)


_FALLBACK_HINT = " (pass options={'fallback': 'eager'} to run it in eager PyTorch instead)"
_warned_ops: set[str] = set()


def _warn_fallback(nodes: list[torch.fx.Node]) -> None:
    """One warning per op kind and process, naming the op and where the user's code calls it."""
    for node in nodes:
        op = diagnostics.op_name(node.target)
        if op in _warned_ops:
            continue
        _warned_ops.add(op)
        warnings.warn(
            f"tpucompile runs {op} in eager PyTorch: {unsupported_reason(node)}", TpuCompileWarning, stacklevel=2
        )


class _CompiledRegion(torch.nn.Module):
    """A compiled region standing in for a partition submodule inside an eagerly run graph."""

    def __init__(self, run: Callable[[list[Any]], list[Any]], returns_tuple: bool) -> None:
        super().__init__()
        self.run = run
        self.returns_tuple = returns_tuple

    def forward(self, *args: Any) -> Any:
        outputs = self.run(list(args))
        return tuple(outputs) if self.returns_tuple else outputs[0]


def _returns_tuple(gm: torch.fx.GraphModule) -> bool:
    return isinstance(gm.graph.output_node().args[0], (tuple, list))


class _EagerGraph:
    """Runs a partitioned graph as Python: eager ATen ops between compiled regions. On meta inputs (a
    compile-only run) an eager op that has no meta kernel fails; the error then names that op and the user's
    source line, not the generated code of the graph."""

    def __init__(self, gm: torch.fx.GraphModule, constants: list[torch.Tensor]) -> None:
        self.gm = gm
        self.constants = constants
        self._boxed_call = True

    def __call__(self, args: list[Any]) -> Any:
        try:
            return self.gm(*args, *self.constants)
        except TpuCompileError:
            raise
        except Exception as error:
            if not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                raise
            node = _failing_node(self.gm, [*args, *self.constants])
            if node is None or node.op != "call_function":  # not one of the eager ops
                raise
            raise UnsupportedOpError(
                f"{diagnostics.describe_node(node)} runs in eager PyTorch here (tpucompile has no lowering for "
                f"it), and it cannot run on the meta tensors of a compile-only run: {str(error).splitlines()[0]}"
            ) from error


def _failing_node(gm: torch.fx.GraphModule, args: list[Any]) -> torch.fx.Node | None:
    """The node of ``gm`` whose op raises on ``args`` (meta tensors: running the graph again costs nothing)."""

    class _Tracking(torch.fx.Interpreter):
        failed: torch.fx.Node | None = None

        def run_node(self, node: torch.fx.Node) -> Any:
            try:
                return super().run_node(node)
            except Exception:
                self.failed = self.failed or node
                raise

    interpreter = _Tracking(gm)
    try:
        interpreter.run(*args)
    except Exception:
        return interpreter.failed
    return None


def _compile_region(
    gm: torch.fx.GraphModule, options: Options, name: str, lifted_constants: list[torch.Tensor]
) -> Callable[[list[Any]], list[Any]]:
    """Lower and compile a fully supported graph, now (static sizes) or per call shape (symbolic sizes)."""
    target = _target(options)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    metas = [n.meta.get("val") for n in placeholders]
    user_arg_count = len(placeholders) - len(lifted_constants)

    def build(bindings: ShapeBindings, constants: list[torch.Tensor] = lifted_constants
              ) -> GraphExecutable | ShapeOnlyExecutable:
        program, program_sha256, program_tier = artifacts.lowered_program(gm, bindings, target, options)
        if options.compile_only:  # for the targets only: nothing is compiled or run for this process
            layouts = _compile_for_targets(gm, bindings, program, program_sha256, target, options, name)
            if layouts is not None and options.shard is not None:  # the backward takes what it saves as laid out
                record_layouts(gm, program.output_plan, layouts, options.shard)
            return ShapeOnlyExecutable(program.output_plan, [(s.shape, s.dtype) for s in program.result_specs],
                                       _output_devices(gm))
        loaded = artifacts.load_executable(program, program_sha256, target, options, name)
        _notify(name, gm, program, program_tier, loaded)
        _compile_for_targets(gm, bindings, program, program_sha256, target, options, name)
        executable = _executable(program, loaded, target, constants, name)
        if isinstance(executable, ShardedExecutable) and options.shard is not None:
            record_layouts(gm, program.output_plan, executable.result_dims, options.shard)
            for position, source in gm.meta.get("dtensor_outputs", {}).items():
                executable.dtensor_outputs[position] = options.shard.dtensors[source]
        return executable

    if not any(is_symbolic(m) for m in metas):
        return build(ShapeBindings())
    if _bucketable(gm, metas, target, options, name):  # the bucketed graph pads the constants with the rest
        def build_for_bucket(bounds: dict, runtime: frozenset) -> GraphExecutable:
            return build(ShapeBindings(bounds, runtime, options.bucket_unmerged_products), [])

        return BucketedGraph(name, gm, build_for_bucket, lifted_constants, options.buckets,
                             options.bucket_minimum, options.max_shape_specializations)

    def build_for_call(args: list[Any]) -> GraphExecutable:
        actual = [*args, *lifted_constants]
        bindings = ShapeBindings.from_inputs(metas, actual)
        bindings.check(metas, actual)
        return build(bindings)

    names = [n.name for n in placeholders[:user_arg_count]]
    return ShapeSpecializer(name, build_for_call, names, options.max_shape_specializations, input_views(gm),
                            [*metas[:user_arg_count]])


def _bucketable(gm: torch.fx.GraphModule, metas: list[Any], target: Any, options: Options, name: str) -> bool:
    """Whether ``gm`` compiles per bucket of sizes: asked for, on one device of this process, and exact under
    padding (else one warning naming the op that is not, and per-size executables)."""
    if options.dynamic_mode != "bucket":
        return False
    why = None
    if options.mesh is not None or len(target.devices) != 1:
        why = "programs over a device mesh compile per size"
    elif not BucketedGraph.readable(metas):
        why = "a size symbol is not the size of any input, so a call cannot say it"
    else:
        found = padding_safety.first_inexact(gm, runtime_symbols(metas))
        why = found[1] if found is not None else None
    if why is not None:
        warnings.warn(f"tpucompile compiles {name} once per size, not per bucket: {why}", TpuCompileWarning,
                      stacklevel=2)
    return why is None


def _output_devices(gm: torch.fx.GraphModule) -> list[torch.device | None]:
    """The device of each output of ``gm`` as traced (None where it is not a tensor)."""
    outputs = gm.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return [getattr(getattr(o, "meta", {}).get("val"), "device", None) for o in outputs]


def load_compiled_graph(program_key: str, options: Options, name: str) -> GraphExecutable | None:
    """The executable of a graph compiled before, rebuilt from its stored program alone (a warm start that
    skips AOTAutograd has no ATen graph); None when the program is no longer stored."""
    global _graphs_compiled
    target = get_target(options.platform)
    found = artifacts.program_from_key(program_key, options)
    if found is None:
        return None
    program, program_sha256, program_tier = found
    _graphs_compiled += 1
    loaded = artifacts.load_executable(program, program_sha256, target, options, name)
    _notify(name, None, program, program_tier, loaded)
    return _executable(program, loaded, target, [], name)


def custom_ops_lowered_whole(options: Options) -> frozenset[str]:
    """The custom ops (``torch.library.custom_op``) that reach the lowering whole in a compile with
    ``options``: those with a lowering rule of tpucompile's, and those whose registered JAX lowerings cover
    every platform the compile lowers for. AOTAutograd traces the others through their implementations."""
    platforms = lowering_platforms(options)
    return frozenset(name for name, op in custom_op_overloads().items()
                     if lookup_rule(op) is not None or custom_ops.lowers(op, platforms))


def attention_kernel_wanted(options: Options) -> bool:
    """Whether attention goes to its kernel op (``options.attention``): in "auto", where a TPU compiles it."""
    if options.attention != "auto":
        return options.attention in ("kernel", "interpret")
    if options.platform == "tpu" or any(target.startswith("tpu") for target in options.targets):
        return True
    if options.platform is None:  # through the runtime, which sets jax up before its backend starts
        return get_target(None).platform == "tpu"
    return False


def lowering_platforms(options: Options) -> frozenset[str]:
    """The platforms a compile with ``options`` lowers its graphs for: its compile-only targets' and, unless
    the compile is only for them, this process's own."""
    platforms = {target_names.parse(name).platform for name in options.targets}
    if not options.compile_only:
        platforms.add(get_target(options.platform).platform)
    return frozenset(platforms)


def _target(options: Options) -> Any:
    """What a graph is lowered for: this process's device or mesh; in a compile-only run, the first target's
    devices (its mesh may be larger than this machine)."""
    size = 1 if options.mesh is None else options.mesh.size
    if options.compile_only:
        others = compile_targets(options.targets, options.platform)
        if others:
            return spanning(others[0], size)
    if options.mesh is None:
        return get_target(options.platform)
    return get_mesh_target(options.platform, size, options.mesh.devices)


def _executable(
    program: LoweredProgram, loaded: artifacts.LoadedExecutable, target: Any, lifted_constants: list, name: str
) -> GraphExecutable | ShardedExecutable:
    if len(target.devices) > 1:
        executable = _sharded_executable(program, loaded, target, lifted_constants)
        memory_accounting.record_program(name, executable, target.devices)
        return executable
    executable = GraphExecutable(
        loaded.executable,
        target.device,
        program.input_positions,
        program.output_plan,
        lifted_constants,
        len(program.result_specs),
        program.input_aliases,
    )
    # Only a program that needs nothing but its arguments can be rebuilt from its key alone.
    executable.program_key = None if lifted_constants else program.cache_key
    _recent.append(weakref.ref(executable))
    memory_accounting.record_program(name, executable, [target.device])
    return executable


def _sharded_executable(
    program: LoweredProgram, loaded: artifacts.LoadedExecutable, target: Any, lifted_constants: list
) -> ShardedExecutable:
    layout = program_shardings(program.module)
    if layout is None or layout.partitions != len(target.devices):
        raise UnsupportedOpError(f"the program compiled for {len(target.devices)} devices carries no sharding "
                                 "for them")
    executable = ShardedExecutable(
        loaded.executable,
        target.devices,
        layout.mesh,
        layout.args,
        [s.shape for s in program.input_specs],
        [(s.shape, s.dtype) for s in program.result_specs],
        [dims is None or any(dims) for dims in layout.results],
        program.input_positions,
        program.output_plan,
        lifted_constants,
    )
    _recent.append(weakref.ref(executable))
    return executable


def _notify(
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


def _compile_for_targets(
    gm: torch.fx.GraphModule, bindings: ShapeBindings, program: LoweredProgram, program_sha256: str,
    run_target: Any, options: Options, name: str,
) -> list[Dims | None] | None:
    """Compile the graph also for every compile-only target of ``options`` and store the executables; a
    target that cannot compile it is reported (a warning, and an event with the reason), never raised: the
    graph still runs here. Returns how the first target lays out each result of a sharded program (None when
    no target says)."""
    layouts = None
    if not options.targets:
        return layouts
    for target in compile_targets(options.targets, options.platform):
        target = spanning(target, len(run_target.devices))
        try:
            target_program, target_sha256, program_tier = artifacts.lowered_program(
                gm, bindings, target, options, lowered=program)
            outcome = artifacts.compile_for_target(target_program, target_sha256, target, options, name,
                                                       keep_executable=_graph_recorder is not None)
        except (LoweringError, UnsupportedOpError, CompileError) as error:
            target_program, program_tier = program, None
            outcome = artifacts.TargetOutcome(str(target.name), "", {}, None, 0.0, 0.0, {}, error=error)
        if outcome.error is not None:
            warnings.warn(f"tpucompile: {outcome.error}", TpuCompileWarning, stacklevel=2)
        elif layouts is None and outcome.report.get("result_dims") is not None:
            layouts = [None if d is None else tuple(tuple(axes) for axes in d) for d in outcome.report["result_dims"]]
        _notify(name, gm, target_program, program_tier, outcome)
        if outcome.executable is not None:  # compiled now: its code (a gigabyte for a large program) goes first
            outcome = None
            release_free_memory()
    return layouts
