"""From a lowered program to what runs it: the executable loaded (or compiled) for this process's devices,
wrapped for one device or a mesh, and the same program compiled and stored for every compile-only target."""

from __future__ import annotations

import warnings

import torch
import torch.fx

from tpucompile import artifacts
from tpucompile.config import Options
from tpucompile.driver import host_kernel_upgrades
from tpucompile.driver.events import count_graph, notify, recording, remember_executable
from tpucompile.driver.resolved_targets import CompileTargets
from tpucompile.errors import CompileError, LoweringError, TpuCompileWarning, UnsupportedOpError
from tpucompile.lowering import LoweredProgram, ShapeBindings
from tpucompile.lowering.shardy_attributes import program_shardings
from tpucompile.metrics import memory_accounting
from tpucompile.runtime import GraphExecutable, ShapeOnlyExecutable, ShardedExecutable, Target
from tpucompile.runtime.host_memory import release_free_memory
from tpucompile.sharding.annotate import record_layouts
from tpucompile.sharding.plan import Dims


def build_executable(
    gm: torch.fx.GraphModule, bindings: ShapeBindings, constants: list[torch.Tensor], targets: CompileTargets,
    options: Options, name: str,
) -> GraphExecutable | ShardedExecutable | ShapeOnlyExecutable:
    """``gm`` at ``bindings`` lowered, compiled for every target and loaded for this process's devices; in a
    compile-only run, only compiled for the targets (what runs here then gives results their shapes alone)."""
    target = targets.lowered_for
    program, program_sha256, program_tier = artifacts.lowered_program(gm, bindings, target, options, targets.tiers)
    if options.compile_only:  # for the targets only: nothing is compiled or run for this process
        layouts = _compile_for_targets(gm, bindings, program, program_sha256, targets, options, name)
        if layouts is not None and options.shard is not None:  # the backward takes what it saves as laid out
            record_layouts(gm, program.output_plan, layouts, options.shard)
        return ShapeOnlyExecutable(program.output_plan, [(s.shape, s.dtype) for s in program.result_specs],
                                   _output_devices(gm))
    loaded = artifacts.load_executable(program, program_sha256, target, options, targets.tiers, name)
    notify(name, gm, program, program_tier, loaded)
    _compile_for_targets(gm, bindings, program, program_sha256, targets, options, name)
    executable = _executable(program, loaded, target, constants, name)
    _upgrade_later(executable, loaded, program, program_sha256, target, options, targets, name)
    if isinstance(executable, ShardedExecutable) and options.shard is not None:
        record_layouts(gm, program.output_plan, executable.result_dims, options.shard)
        for position, source in gm.meta.get("dtensor_outputs", {}).items():
            executable.dtensor_outputs[position] = options.shard.dtensors[source]
    return executable


def load_compiled_graph(program_key: str, options: Options, name: str, targets: CompileTargets
                        ) -> GraphExecutable | None:
    """The executable of a graph compiled before, rebuilt from its stored program alone (a warm start that
    skips AOTAutograd has no ATen graph); None when the program is no longer stored."""
    found = artifacts.program_from_key(program_key, targets.tiers)
    if found is None:
        return None
    program, program_sha256, program_tier = found
    count_graph()
    loaded = artifacts.load_executable(program, program_sha256, targets.lowered_for, options, targets.tiers, name)
    notify(name, None, program, program_tier, loaded)
    executable = _executable(program, loaded, targets.lowered_for, [], name)
    _upgrade_later(executable, loaded, program, program_sha256, targets.lowered_for, options, targets, name)
    return executable


def _upgrade_later(
    executable: GraphExecutable | ShardedExecutable, loaded: artifacts.LoadedExecutable, program: LoweredProgram,
    program_sha256: str, target: Target, options: Options, targets: CompileTargets, name: str,
) -> None:
    """Where ``loaded`` has XLA's ops only until its program is timed with host kernels, compile that program
    in the background and time the two on the graph's calls."""
    if loaded.program_check is not None and isinstance(executable, GraphExecutable):
        host_kernel_upgrades.schedule(executable, loaded, program, program_sha256, target, options, targets.tiers,
                                      name)


def _output_devices(gm: torch.fx.GraphModule) -> list[torch.device | None]:
    """The device of each output of ``gm`` as traced (None where it is not a tensor)."""
    outputs = gm.graph.output_node().args[0]
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return [getattr(getattr(o, "meta", {}).get("val"), "device", None) for o in outputs]


def _executable(
    program: LoweredProgram, loaded: artifacts.LoadedExecutable, target: Target, lifted_constants: list, name: str
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
    remember_executable(executable)
    memory_accounting.record_program(name, executable, [target.device])
    return executable


def _sharded_executable(
    program: LoweredProgram, loaded: artifacts.LoadedExecutable, target: Target, lifted_constants: list
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
    remember_executable(executable)
    return executable


def _compile_for_targets(
    gm: torch.fx.GraphModule, bindings: ShapeBindings, program: LoweredProgram, program_sha256: str,
    targets: CompileTargets, options: Options, name: str,
) -> list[Dims | None] | None:
    """Compile the graph also for every compile-only target and store the executables; a target that cannot
    compile it is reported (a warning, and an event with the reason), never raised: the graph still runs here.
    Returns how the first target lays out each result of a sharded program (None when no target says)."""
    layouts = None
    for target in targets.compile_only:
        try:
            target_program, target_sha256, program_tier = artifacts.lowered_program(
                gm, bindings, target, options, targets.tiers, lowered=program)
            outcome = artifacts.compile_for_target(target_program, target_sha256, target, options, targets.tiers,
                                                   name, keep_executable=recording())
        except (LoweringError, UnsupportedOpError, CompileError) as error:
            target_program, program_tier = program, None
            outcome = artifacts.TargetOutcome(str(target.name), "", {}, None, 0.0, 0.0, {}, error=error)
        if outcome.error is not None:
            warnings.warn(f"tpucompile: {outcome.error}", TpuCompileWarning, stacklevel=2)
        elif layouts is None and outcome.report.get("result_dims") is not None:
            layouts = [None if d is None else tuple(tuple(axes) for axes in d) for d in outcome.report["result_dims"]]
        notify(name, gm, target_program, program_tier, outcome)
        if outcome.executable is not None:  # compiled now: its code (a gigabyte for a large program) goes first
            outcome = None
            release_free_memory()
    return layouts
