"""Warm starts of programs that call runtime libraries (jaxlib's LAPACK kernels, the host BLAS kernels): each is
compiled in one fresh process and run from the cache in another, which must neither crash nor compile."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import sys

import pytest
import torch

from tests import python_processes
from tests.cached_runs import compile_and_run, workload_env
from tests.opinfo.runs import run_sweep
from tpucompile.cache import Entry, LocalStore, decode, encode
from tpucompile.runtime import custom_calls, get_target

_OPS = """
import json, sys, torch
spd = lambda a: a @ a.mT + 4 * torch.eye(a.shape[-1])
OPS = {  # the first calls LAPACK and has a matrix product: it must run before anything sets up LAPACK
    "inv_matmul": lambda a: torch.linalg.inv(a) @ a.T,
    "qr": lambda a: torch.linalg.qr(a)[0],
    "svdvals": torch.linalg.svdvals,
    "solve": lambda a: torch.linalg.solve(a, a[:, :2]),
    "inv": torch.linalg.inv,
    "lu_factor": lambda a: torch.linalg.lu_factor(a)[0],
    "det": torch.linalg.det,
    "lu": lambda a: torch.linalg.lu(a)[2],
    "cholesky": lambda a: torch.linalg.cholesky(spd(a)),
    "eigh": lambda a: torch.linalg.eigh(spd(a))[0],
    "solve_triangular": lambda a: torch.linalg.solve_triangular(spd(a).triu(), a, upper=True),
    "matmul": lambda a: a @ a.T,
    "conv2d": lambda a: torch.nn.functional.conv2d(a.reshape(1, 1, 4, 4).repeat(1, 3, 4, 4),
                                                   a[:3, :3].reshape(1, 1, 3, 3).repeat(4, 3, 1, 1), padding=1),
}
if "--host-always-wins" in sys.argv:  # every timing of the host kernels, ops and whole programs, runs and wins
    from tpucompile.runtime.host_kernels import kernel_choice
    kernel_choice.host_wins = lambda xla_rounds, host_rounds: True
a = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) + 2 * torch.eye(4)
errors = {}
for name, fn in OPS.items():
    torch._dynamo.reset()
    got = torch.compile(fn, backend="tpucompile", fullgraph=True)(a)
    errors[name] = (got - fn(a)).abs().max().item()
print(json.dumps(errors))
"""


def _run_ops(cache_dir, mode: str, *args: str, **settings: str) -> dict[str, float]:
    env = workload_env(cache_dir, TPUCOMPILE_CACHE_MODE=mode, TPUCOMPILE_FALLBACK="error", PYTHONFAULTHANDLER="1",
                       **settings)  # a crash names its frame in the failure
    done = python_processes.run([sys.executable, "-u", "-c", _OPS, *args], capture_output=True, text=True, env=env,
                                timeout=600)
    assert done.returncode == 0, f"exit code {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rewrite_executables(cache_dir, metadata_update: dict) -> None:
    """Every executable entry of the cache at ``cache_dir`` published again with its metadata updated."""
    store = LocalStore(cache_dir)
    for key in store.list_keys():
        entry = decode(store.read(key), key)
        if entry.kind == "executable":
            store.delete(key)
            store.publish(key, encode(Entry(entry.key, entry.kind, entry.components, entry.payload,
                                            {**entry.metadata, **metadata_update}, entry.compile_seconds,
                                            entry.created)))


def _cold_run(tmp_path_factory, host_kernels: str) -> tuple[dict[str, float], pathlib.Path]:
    """The ops compiled cold in one fresh process with ``host_kernels``: (errors, cache)."""
    cache = tmp_path_factory.mktemp(f"cold-host-kernels-{host_kernels}") / "cache"
    errors = _run_ops(cache, "read-write", TPUCOMPILE_HOST_KERNELS=host_kernels)
    assert all(error < 1e-4 for error in errors.values()), errors
    return errors, cache


@pytest.fixture(scope="module")
def cold_host_kernel_run(tmp_path_factory):
    """The cold run with every product calling the host kernels."""
    return _cold_run(tmp_path_factory, "on")


@pytest.fixture(scope="module")
def cold_xla_run(tmp_path_factory):
    """The cold run with XLA's own products."""
    return _cold_run(tmp_path_factory, "off")


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded-calls", "legacy-entries"])
def test_linear_algebra_and_host_kernels_run_warm_in_a_fresh_process(cold_host_kernel_run, tmp_path, recorded):
    """Cold in one process, then warm in another in strict mode (a miss would fail the op): the warm run must
    not crash (jaxlib's LAPACK handlers are only initialised when jax lowers, which a warm start never does)
    and must give the cold run's results. Entries that predate the recorded calls (written as a release that
    did not record them did: no ``custom_calls``) are read off the program."""
    cold, cache = cold_host_kernel_run
    shutil.copytree(cache, tmp_path / "cache")
    if not recorded:
        _rewrite_executables(tmp_path / "cache", {"custom_calls": None})
    warm = _run_ops(tmp_path / "cache", "strict", TPUCOMPILE_HOST_KERNELS="on")
    assert warm == cold


@pytest.mark.parametrize("host_kernels", ["on", "auto"])
def test_programs_lowered_by_another_process_run_when_compiled_now(cold_xla_run, tmp_path, host_kernels):
    """A program whose StableHLO comes from the cache (lowered in another process, so nothing here has set up
    LAPACK) but whose executable is compiled now, here with other host-kernel choices, and, in ``auto``, timed
    alone and in its whole program with the host kernels: neither the timing nor the run may crash."""
    shutil.copytree(cold_xla_run[1], tmp_path / "cache")
    extra = ("--host-always-wins",) if host_kernels == "auto" else ()
    again = _run_ops(tmp_path / "cache", "read-write", *extra, TPUCOMPILE_HOST_KERNELS=host_kernels,
                     TPUCOMPILE_HOST_KERNEL_TIMING="inline", TPUCOMPILE_BUILD_DIR=str(tmp_path / "build"))
    assert all(error < 1e-4 for error in again.values()), again


def test_prepare_initialises_lapack_and_refuses_what_the_process_lacks():
    get_target()  # jax registers its handlers as its backend starts
    assert custom_calls.prepare(["lapack_sgetrf_ffi", "lapack_dpotrf_ffi"], "cpu") is None
    assert "not registered" in custom_calls.prepare(["lapack_sgetrf_ffi", "no_such_kernel_ffi"], "cpu")
    assert "Python object" in custom_calls.prepare(["xla_ffi_python_cpu_callback"], "cpu")
    assert custom_calls.prepare([], "cpu") is None


def test_an_entry_calling_an_unregistered_target_is_a_logged_miss(tmp_path, monkeypatch, caplog):
    """A sound entry whose program calls something this process lacks is not served: it is recompiled (and
    the reason logged), never run."""
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path))
    # Diagonally dominant, so well conditioned: an unseeded near-singular draw made the inverse differ from
    # LAPACK's by float32 rounding times its condition number, which this cache test is not about.
    a = 0.1 * torch.randn(4, 4) + torch.eye(4)
    compile_and_run(torch.linalg.inv, a)
    _rewrite_executables(tmp_path, {"custom_calls": ["not_in_this_process_ffi"]})
    with caplog.at_level(logging.WARNING, logger="tpucompile"):
        result, (event,) = compile_and_run(torch.linalg.inv, a)
    torch.testing.assert_close(result, torch.linalg.inv(a))
    assert event.tier is None, "the entry was served"
    assert "not_in_this_process_ffi" in caplog.text


@pytest.mark.slow
def test_opinfo_programs_replay_warm_in_a_fresh_process(opinfo_floor_sweep, tmp_path):
    """Every kind of program the OpInfo sweep compiles (its first float32 sample of each op) is compiled in one
    process (the floor's sweep) and replayed from the cache, compile forbidden, in another: same outcome for
    every sample."""
    results, cache = opinfo_floor_sweep
    cold = {(r["op"], r["index"]): r["outcome"] for r in results if r["index"] == 0}
    warm = {(r["op"], r["index"]): r["outcome"] for r in run_sweep(cache, "strict", 1, tmp_path / "warm.json")}
    assert sum(outcome == "pass" for outcome in cold.values()) > 500
    changed = {sample: (cold[sample], warm.get(sample)) for sample in cold if warm.get(sample) != cold[sample]}
    assert not changed, changed
