import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from eager_reference import settle_vector_math_dispatch

# Eager results are the reference: settle oneMKL's kernel choice before any test can race on it.
settle_vector_math_dispatch()

# Tests are strict: an op without a lowering fails instead of quietly running in eager PyTorch. The tests of
# the eager fallback itself ask for it explicitly.
os.environ["TPUCOMPILE_FALLBACK"] = "error"

# The persistent compile cache of this test session lives in a temp dir, never in the real home directory;
# tests of the cache itself point TPUCOMPILE_CACHE_DIR at their own tmp_path.
_CACHE_DIR = tempfile.mkdtemp(prefix="tpucompile-test-cache-")
os.environ["TPUCOMPILE_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
# The host BLAS kernel library is built once per test session, there too.
os.environ.setdefault("TPUCOMPILE_BUILD_DIR", os.path.join(_CACHE_DIR, "build"))


@pytest.fixture
def aten_ops(monkeypatch) -> set:
    """The ATen ops of every graph handed to the tpucompile backend during the test, so a test can check
    that the op it is about really reached the lowering (and was not decomposed away before it). Warm starts
    from cached plans are turned off for the test: they skip AOTAutograd, so no ATen graph would be seen."""
    from tpucompile import aot_cache, backend

    monkeypatch.setattr(aot_cache, "compiled_from_plan", lambda *args, **kwargs: None)

    seen: set = set()
    original = backend.compile_graph

    def recording(gm, example_inputs, options, name):
        seen.update(n.target for n in gm.graph.nodes if n.op == "call_function")
        return original(gm, example_inputs, options, name)

    monkeypatch.setattr(backend, "compile_graph", recording)
    return seen


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with Dynamo's caches empty, so recompile limits never turn a test into eager."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
