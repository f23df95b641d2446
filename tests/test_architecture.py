"""Imports flow one way: backend and cli → dump → aot_cache → driver → passes → lowering → cache → runtime.

A package may import itself, the packages below it, and the leaf modules (config, errors, diagnostics).
``cache`` knows bytes and keys, never torch.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tpucompile"
ORDER = [
    "__main__", "backend", "cli", "dump", "aot_cache", "driver", "compile_cache", "passes", "lowering", "cache",
    "runtime",
]
LEAVES = {"config", "errors", "diagnostics", "sharding", "targets", "__init__"}


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        yield ".".join(relative.parts), path


@pytest.mark.parametrize("module,path", list(_sources()), ids=lambda v: str(v) if isinstance(v, str) else "")
def test_imports_flow_down_the_pipeline(module, path):
    unit = _unit(module)
    for imported in _imports(path):
        if not imported.startswith("tpucompile"):
            continue
        target = _unit(imported) if imported != "tpucompile" else "__init__"
        if target == unit:
            continue
        if unit in LEAVES:
            assert target in LEAVES, f"{module} (a leaf module) imports {imported}"
            continue
        if target in LEAVES:
            continue
        assert ORDER.index(target) > ORDER.index(unit), f"{module} imports {imported}, which is upstream of it"


def test_cache_does_not_import_torch():
    for module, path in _sources():
        if _unit(module) == "cache":
            assert not any(name.split(".")[0] == "torch" for name in _imports(path)), module
