"""The whole-program host-kernel check off the compile path (``host_kernel_timing="background"``).

A program's matrix products and convolutions are timed one by one against the host kernels when it is first
compiled (short: one op at a time). The ops that win are then kept only if the whole program gains with them,
and timing the whole program both ways costs two more compiles of it and a dozen runs: on a convolution
network that was most of a cold first call (DenseNet-121's training step on this machine: 44 of 76 s). So
the program is compiled with XLA's ops and runs at once; a worker thread compiles it with the chosen ops
(waiting for the process's compiles to pause first: ``QUIET_SECONDS``); then the graph's next calls
alternate between the two programs (``ProgramTrial``), timed as they run on the user's own inputs and under
the process's own load, and after ``kernel_choice._ROUNDS`` calls of each, the winner by the ops' rule
stays, and the verdict is stored for the machine. Both programs have the same arguments, results and
donations, so a call runs one program or the other, whole.

Nothing here fails a compile or a call: an error in the worker leaves XLA's program in place, with a
warning. At exit the worker stops after the compile it is in.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from tpucompile import artifacts
from tpucompile.config import Options
from tpucompile.lowering import LoweredProgram
from tpucompile.metrics import compile_stats
from tpucompile.runtime import GraphExecutable, Target
from tpucompile.runtime.host_kernels import kernel_choice

log = logging.getLogger("tpucompile")

QUIET_SECONDS = 1.0
"""The worker compiles only once no compile has run in this process for this long: two compiles side by side
slow each other down (two cores here)."""

WARM_UP_CALLS = 1
"""Calls of each program in a trial that are not timed (a program's first run sets up its buffers)."""
TRIAL_CALLS = 2 * (WARM_UP_CALLS + kernel_choice._ROUNDS)
"""Calls of a graph from the start of its trial to its verdict (the two programs alternate)."""


@dataclasses.dataclass(frozen=True)
class Upgrade:
    """One program waiting for its host-kernel check, and the executable that runs it now."""

    executable: weakref.ref
    xla_program: Any
    check: kernel_choice.ProgramCheck
    program: LoweredProgram
    program_sha256: str
    target: Target
    options: Options
    tiers: artifacts.ArtifactTiers
    name: str


class ProgramTrial:
    """Stands in for a graph's loaded executable while two programs of it are timed on its own calls: calls
    alternate between XLA's program and the one with host kernels; once each has run
    ``kernel_choice._ROUNDS`` timed calls, the winner replaces the trial in the graph's executable."""

    def __init__(self, upgrade: Upgrade, host_program: Any) -> None:
        self.upgrade = upgrade
        self.programs = (upgrade.xla_program, host_program)
        self.seconds: tuple[list[float], list[float]] = ([], [])
        self.calls = 0

    def execute(self, arguments: list[Any]) -> list[Any]:
        which = self.calls % 2
        self.calls += 1
        start = time.perf_counter()
        results = self.programs[which].execute(arguments)
        for result in results:
            result.block_until_ready()
        if self.calls > 2 * WARM_UP_CALLS:
            self.seconds[which].append(time.perf_counter() - start)
        if min(len(s) for s in self.seconds) >= kernel_choice._ROUNDS:
            self._decide()
        return results

    def __getattr__(self, name: str) -> Any:  # memory statistics and the like: XLA's program speaks for both
        return getattr(self.programs[0], name)

    def _decide(self) -> None:
        upgrade = self.upgrade
        host = kernel_choice.record_program_verdict(upgrade.check, *self.seconds)
        artifacts.remember_host_ops(upgrade.program_sha256, upgrade.target, upgrade.options.host_kernels,
                                    upgrade.check.ops if host else ())
        owner = upgrade.executable()
        if owner is not None and owner.loaded is self:
            owner.loaded = self.programs[1 if host else 0]
        decided.append((upgrade.name, host))
        log.info("tpucompile: %s %s the host kernels for %d op(s) (its calls: median %.0f us with them, %.0f us "
                 "without)", upgrade.name, "keeps" if host else "drops", len(upgrade.check.ops),
                 _median(self.seconds[1]) * 1e6, _median(self.seconds[0]) * 1e6)


decided: list[tuple[str, bool]] = []
"""(graph name, whether it kept the host kernels) for each trial decided in this process, in order."""

_queue: queue.Queue = queue.Queue()
_stopping = threading.Event()
_state_lock = threading.Lock()
_worker: threading.Thread | None = None
_compiles = 0
_last_compile_end = 0.0


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Mark a compile in progress on this process's compile path (the worker waits for it)."""
    global _compiles, _last_compile_end
    with _state_lock:
        _compiles += 1
    try:
        yield
    finally:
        with _state_lock:
            _compiles -= 1
            _last_compile_end = time.monotonic()


def schedule(executable: GraphExecutable, loaded: artifacts.LoadedExecutable, program: LoweredProgram,
             program_sha256: str, target: Target, options: Options, tiers: artifacts.ArtifactTiers,
             name: str) -> None:
    """Compile ``program`` with the host-kernel ops ``loaded.program_check`` names, in the background, then
    time it against ``loaded`` on ``executable``'s calls."""
    global _worker
    _queue.put(Upgrade(weakref.ref(executable), loaded.executable, loaded.program_check, program, program_sha256,
                       target, options, tiers, name))
    with _state_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="tpucompile-host-kernel-check", daemon=True)
            _worker.start()


def wait(timeout: float | None = None) -> bool:
    """Block until every scheduled compile is done and its trial started; False if ``timeout`` ran out."""
    done = threading.Event()

    def join() -> None:
        _queue.join()
        done.set()

    threading.Thread(target=join, daemon=True).start()
    return done.wait(timeout)


def _work() -> None:
    while True:
        upgrade = _queue.get()
        if upgrade is None:  # the exit's signal
            _queue.task_done()
            return
        try:
            if not _stop_or_wait_for_quiet():
                _start_trial(upgrade)
        except Exception as error:  # never fails anything: the program keeps XLA's ops
            log.warning("tpucompile: the host-kernel program of %s could not be compiled, XLA's ops are kept: "
                        "%s: %s", upgrade.name, type(error).__name__, error)
        finally:
            _queue.task_done()


def _start_trial(upgrade: Upgrade) -> None:
    if upgrade.executable() is None:
        return  # nobody runs the program any more
    loaded = artifacts.load_executable(upgrade.program, upgrade.program_sha256, upgrade.target, upgrade.options,
                                       upgrade.tiers, upgrade.name, host_ops=upgrade.check.ops)
    compile_stats.record_executable(upgrade.name, loaded.tier)  # counted, though no observer sees it
    owner = upgrade.executable()
    if owner is not None and owner.loaded is upgrade.xla_program:
        owner.loaded = ProgramTrial(upgrade, loaded.executable)


def _stop_or_wait_for_quiet() -> bool:
    """Wait until no compile has run for ``QUIET_SECONDS``; True (at once) when the process is exiting."""
    while not _stopping.is_set():
        if _compiles == 0 and time.monotonic() - _last_compile_end >= QUIET_SECONDS:
            return False
        _stopping.wait(0.05)
    return True


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _stop() -> None:
    """At exit: finish the compile in progress, drop the rest (a daemon thread inside XLA at shutdown could
    crash the interpreter's exit)."""
    _stopping.set()
    worker = _worker
    if worker is not None and worker.is_alive():
        _queue.put(None)
        worker.join()


def _after_fork_in_child() -> None:
    """A forked child has no worker thread and may hold a copy of a lock taken in the parent: start afresh."""
    global _queue, _state_lock, _worker, _compiles
    _queue, _state_lock, _worker, _compiles = queue.Queue(), threading.Lock(), None, 0


atexit.register(_stop)
os.register_at_fork(after_in_child=_after_fork_in_child)
