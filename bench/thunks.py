"""Where a compiled step's time goes inside XLA: per program, the thunk time of each kind of work.

    python bench/thunks.py resnet [--mode train|inference] [--steps 20]

Runs the workload of ``bench/models.py`` compiled with tpucompile, then traces ``--steps`` warm steps with
XLA's per-thunk trace events (``--xla_cpu_enable_xprof_traceme``; the python tracer off). Each thunk event is
assigned to the program execution whose window holds it (a training step runs the forward, then the
backward); a thunk that completes asynchronously lasts until its ``end:`` event. Each thunk is classified by
what its HLO computes, read from the program's optimised HLO: a convolution (XLA's own, a YNN fusion holding
one, or a call of the host convolution kernel), a host BLAS product, a reduction, a scatter, a select (max
pooling, ReLU's gradient), a transpose or copy and nothing else (a relayout), elementwise work that reads or
writes through a transpose, or other elementwise work; events that are not thunks (output allocation, input
handling, waits on the pool) are counted apart.

Each program's execution time (the PJRT execute, wall clock) is printed beside its thunk total: thunks of one
program can run at once on XLA's pool threads, so the total can exceed the execution time, and gaps between
thunks (waking a pool thread, waiting on one) make it shorter. Compare kinds and programs within one run.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import os
import re
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from models import WORKLOADS, build

from tpucompile import driver
from tpucompile.runtime.compiler import optimized_hlo

_FLAG = "--xla_cpu_enable_xprof_traceme=true"
"""Makes XLA's CPU runtime emit a trace event per thunk; read when the CPU backend starts."""

_EXECUTION = "CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice"
_NOT_THUNKS = {_EXECUTION, "ThunkExecutor::Execute", "ThunkExecutor::Execute (wait for completion)",
               "CommonPjRtLoadedExecutable::ExecutePrepare", "PythonRefManager::CollectGarbage"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z][\w-]*)\(")
_CALLS = re.compile(r"calls=%([\w.\-]+)")


def classify(hlo: str) -> dict[str, str]:
    """Instruction name -> kind of work, for every instruction of the entry computation of ``hlo``."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = match[1]
            computations[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and line.strip() not in ("", "}"):
            computations[current].append(line)
    kinds = {}
    for line in computations.get(entry, []):
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, opcode = match[1], match[2]
        called = _CALLS.search(line)
        body = "\n".join(computations.get(called[1], [])) if called else line
        kinds[name] = _kind(opcode, line, body)
    return kinds


_MOVES_ONLY = {"parameter", "transpose", "copy", "bitcast", "reshape", "broadcast", "constant", "tuple",
               "get-tuple-element"}
"""Opcodes that only move or repeat data: a fusion of nothing else is a relayout."""


def _kind(opcode: str, line: str, body: str) -> str:
    """What an entry instruction computes, from ``body``: the lines of the computation it calls (a fusion),
    or its own ``line``."""
    if " convolution(" in body or "tpucompile_host_conv" in line:
        return "convolution"
    if "tpucompile_host_gemm" in line or " dot(" in body:
        return "matrix product"
    if " scatter(" in body:
        return "scatter"
    if " reduce(" in body or " reduce-window(" in body:
        return "reduction"
    if " select(" in body and " compare(" in body:
        return "select (pooling, ReLU gradient)"
    if " transpose(" in body or " copy(" in body:
        opcodes = {m[2] for m in (_INSTRUCTION.match(x) for x in body.splitlines()) if m} or {opcode}
        return "transpose or copy" if opcodes <= _MOVES_ONLY else "elementwise, reading or writing transposed"
    return "elementwise, other"


def _by_window(events: list[tuple[int, int, str]],
               windows: list[tuple[int, int]]) -> list[list[tuple[int, int, str]]]:
    """The events inside each program execution's window (``windows`` in time order), in time order."""
    starts = [start for start, _ in windows]
    grouped: list[list[tuple[int, int, str]]] = [[] for _ in windows]
    for event in events:
        index = bisect.bisect_right(starts, event[0]) - 1
        if index >= 0 and event[0] <= windows[index][1] and event[2] not in _NOT_THUNKS:
            grouped[index].append(event)
    return [sorted(group) for group in grouped]


def _thunk_times(events: list[tuple[int, int, str]]) -> list[tuple[str, float]]:
    """(thunk name, microseconds) for each thunk run among ``events``. A thunk that completes asynchronously
    (a convolution split over XLA's pool, a YNN fusion) returns before its work is done; an ``end: NAME``
    event marks when it is, so such a thunk lasts until that marker."""
    pending: dict[str, list[list]] = collections.defaultdict(list)
    runs: list[list] = []
    for start, end, name in events:
        if name.startswith("end: "):
            waiting = pending.get(name.removeprefix("end: "))
            if waiting:
                run = waiting.pop(0)
                run[2] = max(run[2], start)
            continue
        run = [name, start, end]
        runs.append(run)
        pending[name].append(run)
    return [(name, (end - start) / 1e3) for name, start, end in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(WORKLOADS))
    parser.add_argument("--mode", choices=("train", "inference"), default="train")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

    import jax
    from jax._src.lib import _profile_data

    programs: list[tuple[str, str]] = []  # (role, optimised HLO), in compile order
    driver.add_observer(lambda event: programs.append((event.name, optimized_hlo(event.executable))))
    workload = build(args.model)
    model = workload.model
    if args.mode == "train":
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        compiled = torch.compile(model, backend="tpucompile")

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            workload.loss(compiled).backward()
            optimizer.step()
    else:
        if workload.eval_for_inference:
            model.eval()
        compiled = torch.compile(model, backend="tpucompile")

        def step() -> None:
            with torch.no_grad():
                compiled(*workload.inputs)

    for _ in range(10):
        step()
    if len(programs) != (2 if args.mode == "train" else 1):
        sys.exit(f"{args.model} compiled {len(programs)} programs ({[n for n, _ in programs]}); this tool reads "
                 "one inference program or one forward and one backward")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory, profiler_options=options)
        for _ in range(args.steps):
            step()
        jax.profiler.stop_trace()
        trace = _profile_data.ProfileData.from_file(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0])
    events = [(e.start_ns, e.end_ns, e.name) for plane in trace.planes for line in plane.lines for e in line.events]
    windows = sorted((start, end) for start, end, name in events if name == _EXECUTION)
    kinds = [classify(hlo) for _, hlo in programs]
    totals = [collections.Counter() for _ in programs]
    for index, program_events in enumerate(_by_window(events, windows)):
        program = index % len(programs)
        for name, micros in _thunk_times(program_events):
            kind = kinds[program].get(name, "runtime (buffers, inputs, pool waits)")
            totals[program][kind] += micros / args.steps
    walls = [0.0] * len(programs)
    for index, (start, end) in enumerate(windows):
        walls[index % len(programs)] += (end - start) / 1e3 / args.steps
    print(f"{args.model} {args.mode}: per step (us), {args.steps} steps, {len(windows)} executions")
    for (name, _), total, wall in zip(programs, totals, walls, strict=True):
        print(f"  {name}: execution {wall:.0f} us, thunks {sum(total.values()):.0f} us")
        for kind, micros in total.most_common():
            print(f"    {micros:8.0f}  {kind}")


if __name__ == "__main__":
    main()
