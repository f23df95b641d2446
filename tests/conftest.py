"""Session-wide test settings and the fixtures many test files share."""

import gc
import json
import os
import pathlib
import shutil
import tempfile

import pytest
import torch

from tests.dynamo_settings import skip_guard_latency_profiling
from tests.eager_reference import settle_vector_math_dispatch

_CACHE_DIR: str | None = None


def pytest_configure(config):
    """Set the session's environment in this hook rather than when this file is imported: pytest calls it
    once, before it imports any test module, so the variables are in place before anything imports jax or
    tpucompile (nothing imported above does), and importing this file has no side effects.

    Tests are strict: an op without a lowering fails instead of quietly running in eager PyTorch
    (``TPUCOMPILE_FALLBACK=error``; the tests of the eager fallback itself ask for it explicitly). The
    persistent compile cache of the session lives in a temp dir, never in the real home directory (tests of
    the cache itself point ``TPUCOMPILE_CACHE_DIR`` at their own ``tmp_path``), and so does the host BLAS
    kernel library, built once per session. Eager results are the reference: oneMKL's kernel choice is
    settled before any test can race on it.

    CPU programs keep XLA's own dots and convolutions (``TPUCOMPILE_HOST_KERNELS=off``), the path every
    platform shares: the default, "auto", times each new product both ways, which made a test's program depend
    on the machine's load and cost a quarter of the suite's time. The host kernels are tested on their own,
    each mode named: against XLA's ops in ``tests/differential/``, their choice in
    ``tests/runtime/test_kernel_choice.py``, and the README's main example runs with the user's default.
    Dynamo's guard-latency metric is not measured (``skip_guard_latency_profiling``).

    XLA compiles CPU programs at LLVM's level 0 (``TPUCOMPILE_XLA_CPU_OPTIMIZATION_LEVEL=0``): the same HLO
    passes and the same results within the tests' tolerances, in half the compile time, and compiles are most of
    what the suite does after tracing. The README's main example runs at XLA's default level
    (``tests/test_models.py``), and TPU compiles are not affected.
    """
    global _CACHE_DIR
    os.environ["TPUCOMPILE_FALLBACK"] = "error"
    os.environ.setdefault("TPUCOMPILE_HOST_KERNELS", "off")
    os.environ.setdefault("TPUCOMPILE_XLA_CPU_OPTIMIZATION_LEVEL", "0")
    _CACHE_DIR = tempfile.mkdtemp(prefix="tpucompile-test-cache-")
    os.environ["TPUCOMPILE_CACHE_DIR"] = _CACHE_DIR
    os.environ.setdefault("TPUCOMPILE_BUILD_DIR", os.path.join(_CACHE_DIR, "build"))
    settle_vector_math_dispatch()
    skip_guard_latency_profiling()


LONGEST_FIRST = ("tests/artifacts/test_warm_custom_calls.py", "tests/test_examples.py", "tests/moduleinfo/",
                 "tests/sharding/test_sharding.py", "tests/differential/", "tests/opinfo/",
                 "tests/runtime/test_buckets.py", "tests/lowering/test_attention_kernel.py",
                 "tests/lowering/test_grid_sample.py", "tests/artifacts/test_compile_targets.py",
                 "tests/cache/test_fleet.py")
"""The files that take longest, longest first (a full run's per-file times, 40-250 s each): collected first,
so that the parallel workers start them while the short files fill the rest. pytest-xdist hands out whole
files in collection order (``--no-loadscope-reorder``: by default it reorders them by their number of
tests)."""


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if path.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within each file, and among the rest, is kept


_frozen_after: list[str] = []


def pytest_runtest_setup(item):
    """At the first test of each file, what the earlier files left alive (imported modules, OpInfo and model
    definitions, Dynamo's caches) is collected once and then frozen out of the collector's reach. A worker's
    heap grows large, and every full collection, automatic or a test's own ``gc.collect()``, walked all of it
    (three model-heavy files in one process: 46 of their 152 s in full collections, 9 of 113 s with this).
    Garbage is still collected first, and what a test creates stays collectable; objects frozen alive that a
    later file drops in a reference cycle are not reclaimed before the worker ends."""
    path = item.nodeid.split("::")[0]
    if _frozen_after[-1:] != [path]:
        _frozen_after[:] = [path]
        gc.collect()
        gc.freeze()


def pytest_unconfigure(config):
    """Remove the session's cache dir (see ``pytest_configure``)."""
    if _CACHE_DIR is not None:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture
def seeded() -> None:
    """Seeded inputs: torch's global generator reseeded before the test, from ``$TPUCOMPILE_TEST_SEED``
    (default 0), so a failure with random inputs can be rerun with the same ones or with others."""
    torch.manual_seed(int(os.environ.get("TPUCOMPILE_TEST_SEED", "0")))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A persistent cache of the test's own (``$TPUCOMPILE_CACHE_DIR``), empty at the start, in place of the
    session's shared one, so what a test finds cached is only what it compiled itself."""
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def aten_ops(monkeypatch) -> set:
    """The ATen ops of every graph handed to the tpucompile backend during the test, so a test can check
    that the op it is about really reached the lowering (and was not decomposed away before it). Warm starts
    from cached plans are turned off for the test: they skip AOTAutograd, so no ATen graph would be seen."""
    from tpucompile import backend, plan_replay

    monkeypatch.setattr(plan_replay, "compiled_from_plan", lambda *args, **kwargs: None)

    seen: set = set()
    original = backend.compile_graph

    def recording(gm, example_inputs, options, name, targets=None):
        seen.update(n.target for n in gm.graph.nodes if n.op == "call_function")
        return original(gm, example_inputs, options, name, targets)

    monkeypatch.setattr(backend, "compile_graph", recording)
    return seen


@pytest.fixture
def compile_events() -> list:
    """The compile events (``driver.CompileEvent``) of every graph compiled during the test, in order."""
    from tpucompile import driver

    events: list = []
    remove = driver.add_observer(events.append)
    yield events
    remove()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts with Dynamo's caches empty, so recompile limits never turn a test into eager."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def opinfo_floor_sweep(tmp_path_factory) -> tuple[list[dict], pathlib.Path]:
    """The OpInfo floor's samples (``floor.json``: the first samples of every op, float32), run once with a
    persistent cache of their own: (every sample's outcome, the cache). The floor test reads the outcomes; the
    warm-start test replays the programs from the cache in another fresh process. Under pytest-xdist each
    worker has its own session: the first to ask runs the sweep in the folder the workers share, under a file
    lock, and the others read its results."""
    from filelock import FileLock

    from tests.opinfo.runs import FLOOR, run_sweep

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's folder, above each worker's own
    root = shared / "opinfo-floor"
    with FileLock(str(shared / "opinfo-floor.lock")):
        cold = root / "cold.json"
        if cold.exists():
            return json.loads(cold.read_text()), root / "cache"
        root.mkdir(parents=True, exist_ok=True)
        floor = json.loads(FLOOR.read_text())
        return run_sweep(root / "cache", "read-write", floor["max_samples"], cold), root / "cache"
