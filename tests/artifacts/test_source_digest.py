"""Every key that depends on code carries one digest of the whole package's source.

A copy of the package is run in fresh processes: two unedited copies at different paths compute the same keys
(keys are portable across checkouts), and a copy with one edited module (a pass, the CPU rewrite applied after
the key is computed, a lowering rule, the C kernels) computes different program, executable and plan keys.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tpucompile.artifacts import package_digest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "tpucompile"

SCRIPT = r"""
import json, sys
import torch
from tpucompile.cache.entry import decode
from tpucompile.cache.local import LocalStore

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
compiled = torch.compile(model, backend="tpucompile")
compiled(torch.randn(4, 8)).sum().backward()
store = LocalStore(sys.argv[1])
keys = {}
for key in store.list_keys():
    keys.setdefault(decode(store.read(key)).kind, []).append(key)
print(json.dumps({kind: sorted(found) for kind, found in keys.items()}))
"""


def _copy(root: pathlib.Path) -> pathlib.Path:
    shutil.copytree(PACKAGE, root / "tpucompile", ignore=shutil.ignore_patterns("__pycache__"))
    return root / "tpucompile"


def _defining(package: pathlib.Path, text: str, suffix: str = ".py") -> pathlib.Path:
    """The file of ``package`` that holds ``text`` (found by content, so the test follows moves)."""
    (found,) = [p for p in package.rglob(f"*{suffix}") if text in p.read_text()]
    return found


def _keys(package: pathlib.Path, cache: pathlib.Path) -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(package.parent), "TPUCOMPILE_CACHE_DIR": str(cache),
           "TPUCOMPILE_HOST_KERNELS": "off"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=package.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unedited(tmp_path_factory) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("unedited")
    keys = _keys(_copy(root / "a"), root / "cache-a")
    assert {"program", "executable", "plan"} <= set(keys), keys
    assert _keys(_copy(root / "b"), root / "cache-b") == keys  # another path, the same keys
    return keys


EDITS = {
    "a pass": ("def eliminate_dead_code", ".py"),
    "the CPU dot rewrite": ("def dot_replacements", ".py"),
    "a lowering rule": ("aten.gelu.default", ".py"),
    "the host kernels' C source": ("#include", ".c"),
}


@pytest.mark.parametrize("what", EDITS)
def test_an_edit_anywhere_changes_every_key(what, unedited, tmp_path):
    package = _copy(tmp_path)
    text, suffix = EDITS[what]
    candidates = [p for p in package.rglob(f"*{suffix}") if text in p.read_text()]
    if what == "a lowering rule":
        candidates = [p for p in candidates if "rules" in p.parts]
    assert candidates, f"no file of the package holds {text!r}"
    with candidates[0].open("a") as stream:
        stream.write("\n/* edited */\n" if suffix == ".c" else "\n# edited\n")
    keys = _keys(package, tmp_path / "cache")
    for kind in ("program", "executable", "plan"):
        assert keys[kind] and not set(keys[kind]) & set(unedited[kind]), f"{what}: {kind} keys unchanged"


def test_package_digest_covers_every_source_file(tmp_path):
    package = _copy(tmp_path)
    before = package_digest(package)
    assert package_digest(package) == before
    for path in [_defining(package, "def eliminate_dead_code"), _defining(package, "#include", ".c")]:
        path.write_bytes(path.read_bytes() + b"\n")
        edited = package_digest.__wrapped__(package)
        assert edited != before, path
        before = edited
    (package / "notes.txt").write_text("not source")
    assert package_digest.__wrapped__(package) == before
