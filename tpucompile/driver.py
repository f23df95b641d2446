"""Compile one ATen graph: passes → lowering → cache → runtime, and hand back the callable that runs it.

A graph with only static sizes is lowered and compiled at once. A graph with symbolic sizes is compiled
lazily, once per concrete set of sizes seen at call time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from tpucompile import __version__
from tpucompile.cache import MemoryStore, executable_key_components
from tpucompile.cache.keys import cache_key
from tpucompile.config import Options
from tpucompile.lowering import LoweredProgram, ShapeBindings, is_symbolic, lower_graph
from tpucompile.passes import run_passes
from tpucompile.runtime import (
    CONSTANT,
    INPUT,
    RESULT,
    GraphExecutable,
    ShapeSpecializer,
    Target,
    compile_module,
    compile_options,
    get_target,
)

log = logging.getLogger("tpucompile")

_executables: MemoryStore[Any] = MemoryStore(Options().executable_cache_size)
_graphs_compiled = 0


def graphs_compiled() -> int:
    """How many ATen graphs this process has handed to tpucompile (tests use it to prove the backend ran)."""
    return _graphs_compiled


def executable_cache() -> MemoryStore[Any]:
    """The process-wide cache of loaded executables (content-addressed)."""
    return _executables


def compile_graph(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: Options, name: str
) -> Callable[[list[Any]], list[Any]]:
    """The boxed callable that runs ``gm`` (a functional ATen graph from AOTAutograd) on XLA."""
    global _graphs_compiled
    _graphs_compiled += 1
    target = get_target(options.platform)
    _executables.resize(options.executable_cache_size)
    passes = run_passes(gm, options.embed_constant_limit)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    metas = [n.meta.get("val") for n in placeholders]
    user_arg_count = len(placeholders) - len(passes.lifted_constants)

    def build(bindings: ShapeBindings) -> GraphExecutable:
        program = lower_graph(gm, bindings, verify=options.verify)
        loaded = load_executable(program, target, name)
        return GraphExecutable(
            loaded,
            target.device,
            program.input_positions,
            _output_plan(program),
            passes.lifted_constants,
        )

    if not any(is_symbolic(m) for m in metas):
        return build(ShapeBindings())

    def build_for_call(args: list[Any]) -> GraphExecutable:
        actual = [*args, *passes.lifted_constants]
        bindings = ShapeBindings.from_inputs(metas, actual)
        bindings.check(metas, actual)
        return build(bindings)

    names = [n.name for n in placeholders[:user_arg_count]]
    return ShapeSpecializer(name, build_for_call, names, options.max_shape_specializations)


def load_executable(program: LoweredProgram, target: Target, name: str) -> Any:
    """A loaded executable for ``program``: from the in-process cache, or compiled now."""
    components = executable_key_components(
        program.text(debug_info=False),
        target.describe(),
        compile_options().SerializeAsString(),
        __version__,
    )
    key = cache_key(components)
    loaded = _executables.get(key)
    if loaded is not None:
        log.debug("tpucompile: %s executable cache hit %s", name, key[:12])
        return loaded
    start = time.perf_counter()
    loaded = compile_module(program.bytecode(), target)
    log.debug("tpucompile: compiled %s in %.1f ms (key %s)", name, (time.perf_counter() - start) * 1e3, key[:12])
    _executables.put(key, loaded)
    return loaded


def _output_plan(program: LoweredProgram) -> list[tuple[int, Any]]:
    kinds = {"result": RESULT, "input": INPUT, "constant": CONSTANT}
    return [
        (kinds[slot.kind], slot.value if slot.kind == "constant" else slot.index)
        for slot in program.output_plan
    ]
