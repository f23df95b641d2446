"""The per-op choice between the host kernels and XLA's own dots and convolutions: measured once per machine,
stored, part of the executable key, and never a change in results."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests import python_processes
from tests.cached_runs import fresh_start
from tpucompile.runtime import get_target, optimized_hlo
from tpucompile.runtime.host_kernels import kernel_choice
from tpucompile.runtime.host_kernels.library import CONV_TARGET_NAME, TARGET_NAME, kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="the host kernels cannot be built here")


def model(x, w, k):
    return torch.nn.functional.conv2d(torch.tanh(x @ w), k, padding=1).sum(1)


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, 20, 16, generator=generator), torch.randn(16, 20, generator=generator),
            torch.randn(4, 3, 3, 3, generator=generator))


def _compile(mode: str):
    """(result, events) of ``model`` compiled fresh with ``host_kernels=mode``, timed before the compile."""
    with fresh_start() as events:
        result = torch.compile(model, backend="tpucompile",
                               options={"host_kernels": mode, "host_kernel_timing": "inline"})(*_inputs())
    return result, events


@pytest.fixture
def decisions(tmp_path, monkeypatch):
    """A fresh decision file (and cache) for the test, with the timing replaced by ``timings``' verdict."""
    monkeypatch.setenv("TPUCOMPILE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_choice, "_decisions", lambda: store)
    store = kernel_choice._Decisions(tmp_path / "choices.json")
    timings = {"host_faster": True, "calls": 0}

    def fake_time_both(xla_program, host_program, target):
        timings["calls"] += 1
        return ([2e-3] * 3, [1e-3] * 3) if timings["host_faster"] else ([1e-3] * 3, [1e-3] * 3)

    monkeypatch.setattr(kernel_choice, "time_both", fake_time_both)
    return store, timings


def _host_calls(events) -> int:
    hlo = "".join(optimized_hlo(e.executable) for e in events)
    return hlo.count(f'custom_call_target="{TARGET_NAME}"') + hlo.count(f'custom_call_target="{CONV_TARGET_NAME}"')


@pytest.mark.parametrize("host_faster", [True, False])
def test_auto_sends_an_op_to_the_host_kernel_only_where_it_was_measured_faster(decisions, host_faster):
    store, timings = decisions
    timings["host_faster"] = host_faster
    result, events = _compile("auto")
    torch.testing.assert_close(result, model(*_inputs()), rtol=1e-4, atol=1e-4)
    # the dot and the convolution are timed once each, then (when they won) the program with them
    assert timings["calls"] == (3 if host_faster else 2)
    assert _host_calls(events) == (2 if host_faster else 0)
    (event,) = events
    assert len(event.key_components["host_ops"]) == (2 if host_faster else 0)
    stored = json.loads(store.path.read_text())
    ops = {sign: d for sign, d in stored.items() if not d["op"].startswith("a program")}
    assert sorted(ops) == sorted(kernel_choice.chosen_ops(event.program.bytecode(), _target(), "on"))
    assert len(stored) - len(ops) == (1 if host_faster else 0)
    assert all(d["host"] is host_faster for d in stored.values())


def test_ops_that_win_alone_are_dropped_when_their_program_does_not_gain(decisions, monkeypatch):
    """Faster alone, slower in the program (fusions lost around the calls): XLA's ops everywhere."""
    store, _ = decisions
    calls = []

    def alone_faster_together_slower(xla_program, host_program, target):
        calls.append(xla_program)
        return ([2e-3] * 3, [1e-3] * 3) if len(calls) <= 2 else ([1e-3] * 3, [2e-3] * 3)

    monkeypatch.setattr(kernel_choice, "time_both", alone_faster_together_slower)
    result, (event,) = _compile("auto")
    torch.testing.assert_close(result, model(*_inputs()), rtol=1e-4, atol=1e-4)
    assert len(calls) == 3 and "stablehlo.convolution" in calls[2] and "stablehlo.dot_general" in calls[2]
    assert event.key_components["host_ops"] == [] and _host_calls([event]) == 0
    verdicts = sorted((d["op"].startswith("a program"), d["host"]) for d in json.loads(store.path.read_text()).values())
    assert verdicts == [(False, True), (False, True), (True, False)]


def test_a_whole_program_with_integer_inputs_is_timed():
    """The program check runs programs whose arguments are indices and seeds, not only floats."""

    def lookup(indices, table, weight):
        return torch.nn.functional.dropout(table[indices] @ weight, 0.1) + torch.rand(weight.shape[1])

    generator = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 50, (6,), generator=generator), torch.randn(50, 16, generator=generator),
            torch.randn(16, 8, generator=generator))
    with fresh_start() as events:
        torch.compile(lookup, backend="tpucompile", options={"host_kernels": "off"})(*args)
    (event,) = events
    program = event.program.text(debug_info=False)
    assert "xi64>" in program
    chosen = kernel_choice.chosen_ops(program, _target(), "on")
    host = kernel_choice.apply(program, _target(), chosen)
    assert chosen and host != program
    xla_rounds, host_rounds = kernel_choice.time_both(program, host, _target())
    assert len(xla_rounds) == len(host_rounds) == kernel_choice._ROUNDS
    assert all(t > 0 for t in [*xla_rounds, *host_rounds])


def test_decisions_are_reused_and_the_choice_is_part_of_the_key(decisions):
    store, timings = decisions
    _, (first,) = _compile("auto")
    _, (again,) = _compile("auto")
    assert timings["calls"] == 3 and again.tier == "local" and again.key == first.key
    # another process of this machine reads the stored decisions instead of timing again
    assert kernel_choice._Decisions(store.path).known == store.known
    _, (off,) = _compile("off")
    _, (on,) = _compile("on")
    assert off.key_components["host_ops"] == [] and _host_calls([off]) == 0
    assert on.key_components["host_ops"] == first.key_components["host_ops"]
    assert off.key != first.key and on.key == first.key


def test_every_mode_gives_the_same_results(tmp_path, monkeypatch, caplog):
    """With real timing (inside the compile, where Dynamo's fake tensor mode is active): it runs, and every
    mode computes the same."""
    monkeypatch.setattr(kernel_choice, "_decisions", lambda: store)
    store = kernel_choice._Decisions(tmp_path / "choices.json")
    results = {mode: _compile(mode)[0] for mode in ("off", "on", "auto")}
    stored = json.loads(store.path.read_text()).values()
    assert sum(not d["op"].startswith("a program") for d in stored) == 2, "the dot and the convolution were timed"
    assert "could not time" not in caplog.text
    torch.testing.assert_close(results["on"], results["off"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["auto"], results["off"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_timing_compares_the_two_programs_of_one_op(dtype):
    """The real timing of a product both ways gives positive times per round (their ratio is the machine's)."""
    from jax.extend.mlir import ir

    from tpucompile.runtime.mlir_walk import context, walk_operations

    text = """func.func public @main(%a: tensor<64x32xf32>, %b: tensor<48x32xf32>) -> tensor<64x48xf32> {
      %t = stablehlo.transpose %b, dims = [1, 0] : (tensor<48x32xf32>) -> tensor<32x48xf32>
      %0 = stablehlo.dot_general %a, %t, contracting_dims = [1] x [0] : (tensor<64x32xf32>, tensor<32x48xf32>)
             -> tensor<64x48xf32>
      return %0 : tensor<64x48xf32>
    }""".replace("xf32>", f"x{dtype}>")
    with context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        (dot,) = [op for op in walk_operations(module.operation) if op.name == "stablehlo.dot_general"]
        micro = kernel_choice.micro_program(dot)
    assert "stablehlo.transpose" in micro, "the transpose the kernel reads through is part of the op"
    host = kernel_choice.apply(micro, _target(), None)
    assert TARGET_NAME.encode() in host if isinstance(host, bytes) else TARGET_NAME in host
    xla_rounds, host_rounds = kernel_choice.time_both(micro, host, _target())
    assert len(xla_rounds) == len(host_rounds) == kernel_choice._ROUNDS
    assert all(0 < seconds < 1 for seconds in xla_rounds + host_rounds)


def test_the_host_kernel_wins_only_clearly_and_not_when_it_stalls():
    assert kernel_choice.host_wins([1.0, 1.0, 1.1], [0.9, 0.9, 0.95])
    assert not kernel_choice.host_wins([1.0, 1.0, 1.1], [0.97, 0.97, 0.97]), "inside the noise: XLA"
    assert not kernel_choice.host_wins([1.0, 1.0, 1.1], [0.5, 9.0, 9.0]), "fast at best, stalls in the median"


def _target():
    return get_target(None)


def test_a_timing_that_fails_keeps_xla_and_the_compile_goes_on(decisions, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no timer here")

    monkeypatch.setattr(kernel_choice, "time_both", broken)
    result, (event,) = _compile("auto")
    torch.testing.assert_close(result, model(*_inputs()), rtol=1e-4, atol=1e-4)
    assert event.key_components["host_ops"] == [] and _host_calls([event]) == 0
    assert "could not time the host kernel" in caplog.text


_STALLED_TIMER = """
import os, pathlib, signal, sys
import torch
from tpucompile.runtime.host_kernels import kernel_choice

store = kernel_choice._Decisions(pathlib.Path(sys.argv[1]))
kernel_choice._decisions = lambda: store


def stall(*args):
    print("timing", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped mid-compile, holding the machine's timing lock


kernel_choice.time_both = stall
x, w = torch.randn(8, 16), torch.randn(16, 4)
torch.compile(lambda x, w: torch.tanh(x @ w), backend="tpucompile",
              options={"host_kernels": "auto", "host_kernel_timing": "inline"})(x, w)
"""


def test_a_process_stopped_while_timing_never_stalls_another_compile(decisions, tmp_path):
    """The holder of the machine's timing lock stops mid-compile (SIGSTOP): another process's compile goes on
    at once with XLA's ops, and once the holder is gone, a later compile times and takes the decision."""
    store, timings = decisions
    holder = python_processes.popen([sys.executable, "-c", _STALLED_TIMER, str(store.path)],
                                    stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "timing"
        start = time.monotonic()
        result, (event,) = _compile("auto")
        waited = time.monotonic() - start
        torch.testing.assert_close(result, model(*_inputs()), rtol=1e-4, atol=1e-4)
        assert event.key_components["host_ops"] == [] and timings["calls"] == 0
        assert waited < kernel_choice._LOCK_PATIENCE_SECONDS + 30, waited
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    result, (event,) = _compile("auto")
    torch.testing.assert_close(result, model(*_inputs()), rtol=1e-4, atol=1e-4)
    assert timings["calls"] == 3 and len(event.key_components["host_ops"]) == 2
