"""The whole-program host-kernel check off the compile path (``host_kernel_timing="background"``): a program
whose chosen ops are not yet checked in the program runs with XLA's ops at once, the program with the ops is
compiled by a worker thread, the two are timed on the graph's own calls and the winner stays; the results never
change, and nothing fails or hangs at exit."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

from tests import python_processes
from tests.cached_runs import fresh_start
from tests.runtime.test_kernel_choice import _host_calls, _inputs, decisions, model  # noqa: F401  (fixture)
from tpucompile import driver
from tpucompile.driver import host_kernel_upgrades
from tpucompile.runtime import optimized_hlo
from tpucompile.runtime.host_kernels import kernel_choice
from tpucompile.runtime.host_kernels.library import CONV_TARGET_NAME, TARGET_NAME, kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="the host kernels cannot be built here")


def _calls_host_kernels(loaded) -> int:
    hlo = optimized_hlo(loaded)
    return hlo.count(f'custom_call_target="{TARGET_NAME}"') + hlo.count(f'custom_call_target="{CONV_TARGET_NAME}"')


def _training_step(timing: str):
    """The model with a weight to train, compiled with ``host_kernels="auto"`` and ``timing``."""
    x, w, k = _inputs()
    w = w.clone().requires_grad_()

    def step(compiled):
        w.grad = None
        out = compiled(x, w, k)
        out.square().sum().backward()
        return out.detach(), w.grad.clone()

    return step, torch.compile(model, backend="tpucompile",
                               options={"host_kernels": "auto", "host_kernel_timing": timing})


def _assert_close_to_eager(value: torch.Tensor, reference: torch.Tensor) -> None:
    """A training step's result against eager's. The weight's gradient sums terms up to ~1400 that cancel to
    values near 1 in places, where any float32 order of the sum is off by a few 1e-4 (programs with and
    without the host kernels alike, at either XLA optimisation level; eager's own order happens to be closer):
    the absolute tolerance follows the largest entry, 1e-6 of it, and is 1e-4 at least."""
    atol = max(1e-4, 1e-6 * reference.abs().max().item())
    torch.testing.assert_close(value, reference, rtol=1e-4, atol=atol)


def _run_until_decided(step, compiled, expected, before: int, graphs: int = 2) -> None:
    """Training steps until the trials of ``graphs`` graphs are decided, every one checked against eager."""
    for _ in range(host_kernel_upgrades.TRIAL_CALLS + 1):
        for value, reference in zip(step(compiled), expected, strict=True):
            _assert_close_to_eager(value, reference)
        if len(host_kernel_upgrades.decided) - before == graphs:
            return
    raise AssertionError(f"undecided: {host_kernel_upgrades.decided[before:]}")


@pytest.mark.parametrize(("ops_win", "program_wins"), [(True, True), (True, False), (False, None)])
def test_the_program_check_runs_on_the_graphs_own_calls(decisions, monkeypatch, ops_win, program_wins):  # noqa: F811
    """The ops are timed before the compile; the programs run with XLA's ops at once; where ops won, the
    program with them is compiled in the background and the two are timed on the next calls, and the winner
    stays. Every result on the way equals eager's."""
    store, timings = decisions
    timings["host_faster"] = ops_win
    before = len(host_kernel_upgrades.decided)
    step, compiled = _training_step("background")
    expected = step(model)
    with fresh_start() as events:
        for value, reference in zip(step(compiled), expected, strict=True):
            _assert_close_to_eager(value, reference)
        assert len(events) == 2 and all(e.key_components["host_ops"] == [] for e in events), \
            "the first programs have XLA's ops: their programs were not timed before them"
        assert all(_calls_host_kernels(e.executable) == 0 for e in events)
        assert timings["calls"] == 4, "forward and backward each timed their dot and convolution alone"
        running = driver.recent_executables()[-2:]
        assert host_kernel_upgrades.wait(timeout=120)
        if ops_win:
            assert all(isinstance(e.loaded, host_kernel_upgrades.ProgramTrial) for e in running)
            monkeypatch.setattr(kernel_choice, "host_wins", lambda xla_rounds, host_rounds: program_wins)
            _run_until_decided(step, compiled, expected, before)
            assert sorted(host_kernel_upgrades.decided[before:]) == sorted((e.name, program_wins) for e in events)
        else:
            assert all(e.loaded is x.executable for e, x in zip(running, events, strict=True))
    assert timings["calls"] == 4, "the programs were timed on their calls, not by separate runs"
    assert sum(_calls_host_kernels(e.loaded) > 0 for e in running) == (2 if program_wins else 0)
    stored = [d for d in json.loads(store.path.read_text()).values() if d["op"].startswith("a program")]
    assert [d["host"] for d in stored] == ([program_wins] * 2 if ops_win else [])


def test_inline_timing_compiles_the_winner_first(decisions):  # noqa: F811
    step, compiled = _training_step("inline")
    expected = step(model)
    with fresh_start() as events:
        got = step(compiled)
    assert len(events) == 2 and all(len(e.key_components["host_ops"]) == 2 for e in events)
    assert _host_calls(events) == 4
    assert host_kernel_upgrades._queue.unfinished_tasks == 0, "nothing left for the background"
    for value, reference in zip(got, expected, strict=True):
        _assert_close_to_eager(value, reference)


def test_a_later_process_takes_the_stored_choice_without_a_trial(decisions):  # noqa: F811
    """Once decided on the calls of one process, a new compile of the program (a fresh start: another
    process) gets the kernels at once and starts nothing in the background."""
    _, timings = decisions
    before = len(host_kernel_upgrades.decided)
    step, compiled = _training_step("background")
    expected = step(model)
    with fresh_start():
        step(compiled)
        assert host_kernel_upgrades.wait(timeout=120)
        _run_until_decided(step, compiled, expected, before)
    # measured for real: either may win here; by role, as the graphs' numbers go on
    verdicts = {name.split(" ")[-1]: host for name, host in host_kernel_upgrades.decided[before:]}
    step, compiled = _training_step("background")
    with fresh_start() as events:
        step(compiled)
    assert {e.name.split(" ")[-1]: len(e.key_components["host_ops"]) == 2 for e in events} == verdicts
    assert host_kernel_upgrades._queue.unfinished_tasks == 0 and timings["calls"] == 4


_EXITS_WHILE_COMPILING = """
import time
import torch
from tpucompile.driver import host_kernel_upgrades
from tpucompile.runtime.host_kernels import kernel_choice

kernel_choice.host_wins = lambda xla_rounds, host_rounds: True  # every op wins: the program is checked
host_kernel_upgrades.QUIET_SECONDS = 0
x, w, k = torch.randn(2, 3, 20, 16), torch.randn(16, 20), torch.randn(4, 3, 3, 3)
f = lambda x, w, k: torch.nn.functional.conv2d(torch.tanh(x @ w), k, padding=1).sum(1)
out = torch.compile(f, backend="tpucompile", options={"host_kernels": "auto", "host_kernel_timing": "background"})
torch.testing.assert_close(out(x, w, k), f(x, w, k), rtol=1e-4, atol=1e-4)
assert host_kernel_upgrades._queue.unfinished_tasks == 1
time.sleep(0.05)  # the worker is compiling as the interpreter exits
print("ran", flush=True)
"""


def test_a_process_exits_cleanly_while_its_programs_are_timed(tmp_path):
    """The interpreter exits while the worker compiles: it stops after that compile, and the exit is clean
    (no crash inside XLA at shutdown)."""
    env = {"TPUCOMPILE_CACHE_DIR": str(tmp_path / "cache"), "TPUCOMPILE_BUILD_DIR": str(tmp_path / "build"),
           "PYTHONFAULTHANDLER": "1"}
    start = time.monotonic()
    done = python_processes.run([sys.executable, "-c", _EXITS_WHILE_COMPILING], capture_output=True, text=True,
                                timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran" in done.stdout
    assert time.monotonic() - start < 240


def test_the_option_is_checked():
    with pytest.raises(Exception, match="host_kernel_timing"):
        torch.compile(model, backend="tpucompile", options={"host_kernel_timing": "later"})(*_inputs())
    torch._dynamo.reset()


def test_no_background_work_where_the_choice_needs_none():
    """``host_kernels="off"`` (the suite's setting) and "on" decide at once: nothing is scheduled."""
    for mode in ("off", "on"):
        with fresh_start() as events:
            torch.compile(model, backend="tpucompile", options={"host_kernels": mode})(*_inputs())
        (event,) = events
        assert driver.recent_executables()[-1].loaded is event.executable, "the program compiled is the one run"
        assert host_kernel_upgrades._queue.unfinished_tasks == 0
