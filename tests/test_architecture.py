"""The pipeline's layering, checked on the source: imports flow one way, top to bottom.

    backend, cli → exporting → debug → plan_replay → driver → artifacts → frontend → passes → sharding → lowering
    → cache → runtime → serving

A unit (a top-level module or package of ``tpucompile``) may import itself, the units below it, and the leaves
(configuration, errors, and the ``contracts`` and ``metrics`` packages, importable from anywhere). On top of the
order: graph rewrites (``frontend``, ``passes``) load neither MLIR's lowering nor the runtime, not even indirectly;
``cache`` knows bytes and keys, never torch; ``serving`` runs exported programs with numpy and jax alone, never
torch; a lowering rule builds on the shared ``lowering.builder``, never on another rule. The root package's
``export`` and ``load`` import ``exporting`` when called, never when ``tpucompile`` is imported. The tests mirror
the package: a folder per unit.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tpucompile"
ORDER = [
    "__main__", "backend", "cli", "exporting", "debug", "plan_replay", "driver", "artifacts", "frontend", "passes",
    "sharding", "lowering", "cache", "runtime", "serving",
]
LEAF_UNITS = {"contracts", "metrics"}
"""Packages of contracts several layers share and of process metrics, importable from anywhere."""
LEAF_MODULES = {"tpucompile", "tpucompile.config", "tpucompile.errors", "tpucompile.diagnostics",
                "tpucompile.sharding.plan"}
"""Modules any unit may import (with those of ``LEAF_UNITS``): they import only each other (and torch, sympy or
the standard library)."""


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _is_leaf(module: str) -> bool:
    return module in LEAF_MODULES or _unit(module) in LEAF_UNITS


def _imports(path: pathlib.Path) -> list[str]:
    """The absolute module names ``path`` imports (``from a import b`` may name the module ``a.b``: both)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _sources() -> dict[str, pathlib.Path]:
    sources = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = relative.parts[:-1] if relative.parts[-1] == "__init__" else relative.parts
        sources[".".join(parts)] = path
    return sources


SOURCES = _sources()


def _own_imports(module: str) -> list[str]:
    """The package modules ``module`` imports (names of functions and classes dropped)."""
    return [name for name in _imports(SOURCES[module]) if name in SOURCES]


ROOT_CALLS_INTO = {"tpucompile.exporting", "tpucompile.exporting.writer", "tpucompile.exporting.torch_loader"}
"""What the root package's functions import when they are called (``tpucompile.export``, ``tpucompile.load``)."""


def _module_level_imports(path: pathlib.Path) -> list[str]:
    """The absolute module names ``path`` imports outside any function."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return found


def test_root_package_imports_exporting_only_when_called():
    assert not set(_module_level_imports(SOURCES["tpucompile"])) & ROOT_CALLS_INTO


@pytest.mark.parametrize("module", list(SOURCES))
def test_imports_flow_down_the_pipeline(module):
    unit = _unit(module)
    for imported in _own_imports(module):
        target = _unit(imported)
        if _is_leaf(imported) or target == unit or (module == "tpucompile" and imported in ROOT_CALLS_INTO):
            continue
        assert not _is_leaf(module), f"{module} (a leaf module) imports {imported}"
        assert ORDER.index(target) > ORDER.index(unit), f"{module} imports {imported}, which is upstream of it"


def _closure(module: str) -> set[str]:
    """Every package module importing ``module`` loads, through the packages that hold each of them (but the
    root package, whose ``__init__`` only re-exports)."""
    seen: set[str] = set()
    pending = [module]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        parts = current.split(".")
        parents = [".".join(parts[:i]) for i in range(2, len(parts))]
        pending += [m for m in (*_own_imports(current), *parents) if m != "tpucompile"]
    return seen


@pytest.mark.parametrize("module", [m for m in SOURCES if _unit(m) in ("frontend", "passes")])
def test_graph_rewrites_load_neither_lowering_nor_runtime(module):
    loaded = sorted(m for m in _closure(module) if _unit(m) in ("lowering", "runtime", "artifacts", "driver"))
    assert not loaded, f"{module} loads {loaded}"


def test_serving_does_not_import_torch():
    imported = [name for name in _imports(SOURCES["tpucompile.serving"]) if name.split(".")[0] == "torch"]
    assert not imported and all(_unit(m) in ("serving",) or _is_leaf(m) for m in _own_imports("tpucompile.serving"))


def test_cache_does_not_import_torch():
    for module, path in SOURCES.items():
        if _unit(module) == "cache":
            assert not any(name.split(".")[0] == "torch" for name in _imports(path)), module


@pytest.mark.parametrize("module", [m for m in SOURCES if m.startswith("tpucompile.lowering.rules.")])
def test_lowering_rules_do_not_import_each_other(module):
    others = [m for m in _own_imports(module) if m.startswith("tpucompile.lowering.rules.") and m != module]
    assert not others, f"{module} imports {others}: shared helpers belong in tpucompile.lowering.builder"


def test_every_op_kept_whole_has_a_lowering_rule():
    """An op kept out of the decomposition table reaches the lowering whole, so it must have a rule."""
    import tpucompile.lowering  # noqa: F401  (registers every rule)
    from tpucompile.frontend.decompositions import LOWERED_WHOLE
    from tpucompile.lowering.registry import lookup_rule

    missing = [str(op) for op in LOWERED_WHOLE if lookup_rule(op) is None]
    assert not missing, f"kept whole but never lowered: {missing}"


TESTS = pathlib.Path(__file__).resolve().parent
SUITES = {"opinfo", "moduleinfo", "differential", "models", "bench"}
"""Test folders that are not a unit's: the peer suites, differential tests, library models, benchmarks."""
TOP_LEVEL_TESTS = {"test_architecture.py", "test_backend.py", "test_eager_reference.py", "test_examples.py",
                   "test_models.py", "test_python_processes.py"}
"""Test files at the top: the layering, the backend as a user meets it, the eager reference and the forked
processes the tests run in, whole models."""


def test_the_tests_mirror_the_package():
    """A test folder per unit (``tests/<unit>/`` tests ``tpucompile/<unit>/``) or suite; nothing else flat."""
    units = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    folders = {path.name for path in TESTS.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    strays = sorted(folders - units - SUITES)
    assert not strays, f"test folders that name no unit of the package: {strays}"
    flat = {path.name for path in TESTS.glob("test_*.py")}
    assert flat <= TOP_LEVEL_TESTS, f"test files that belong in a unit's folder: {sorted(flat - TOP_LEVEL_TESTS)}"


MOST_ENTRIES_PER_ROOM = 4
"""How many distinct call sites may hand a compile's options into one module: more means a room is climbed back
into from all over the pipeline, the sign of a setting worked out again where it is used."""


def _options_flow(run: Callable[[], Any]) -> list[tuple[str, str]]:
    """(caller module, callee module) for each distinct cross-module call into a ``tpucompile`` function given the
    compile's ``Options`` while ``run`` runs; the caller is the nearest frame given them too (the backend's entry,
    ``tpucompile.backend``, when none is)."""
    from tpucompile.config import Options

    modules = {str(path): name for name, path in SOURCES.items()}
    stack: list[str | None] = []
    calls: list[tuple[str, str, str]] = []

    def module_given_options(frame: Any) -> str | None:
        code = frame.f_code
        module = modules.get(code.co_filename)
        arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if module is None or not any(isinstance(frame.f_locals.get(name), Options) for name in arguments):
            return None
        return module

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call":
            module = module_given_options(frame)
            if module is not None:
                caller = next((m for m in reversed(stack) if m is not None), "tpucompile.backend")
                if caller != module and (caller, module, frame.f_code.co_name) not in calls:
                    calls.append((caller, module, frame.f_code.co_name))
            stack.append(module)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return [(caller, module) for caller, module, _ in calls]


def test_options_are_worked_out_once_and_flow_down(cache_dir):
    """Follow the options of a training compile from the backend's entry: every module they reach is entered
    from a handful of places at most, and always from upstream (targets and cache tiers are resolved once, at
    the entry, and handed down as a record)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    compiled = torch.compile(model, backend="tpucompile", options={"cache_dir": str(cache_dir)})
    flow = _options_flow(lambda: compiled(torch.randn(4, 8)).sum().backward())

    assert ("tpucompile.driver.resolved_targets", "tpucompile.artifacts.stores") in flow  # followed at all
    entries = collections.Counter(module for _, module in flow)
    crowded = {module: count for module, count in entries.items() if count > MOST_ENTRIES_PER_ROOM}
    assert not crowded, f"options enter these modules from more than {MOST_ENTRIES_PER_ROOM} places: {crowded}"
    climbs = [(caller, module) for caller, module in flow
              if ORDER.index(_unit(module)) < ORDER.index(_unit(caller))]
    assert not climbs, f"options handed back up the pipeline: {climbs}"
