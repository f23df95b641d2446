"""One simulated host of a fleet: runs the workload's model under several cache settings in turn, in one
process (imports are most of a process's start, and the fleet tests start many), and prints one JSON line
per step as soon as it is done (so a host killed later has reported the steps before).

    python -m tests.cache.fleet_host PLAN.json        (from the repository root)

PLAN: ``{"signals": DIR, "steps": [STEP, ...]}``, each STEP ``{"name", "options", "scale", "train", "gate",
"compile_delay"}``. Before a step with a ``gate``, the host touches ``DIR/at-<gate>-<pid>`` and waits for
``DIR/<gate>``, which the test creates when it wants the hosts to go (so that they race, or after it has set
something up). The host notes when each XLA compile starts; with ``compile_delay`` each first touches
``DIR/compiling-<name>-<pid>`` and sleeps that long (a slow compile; a host to kill while it holds a key).
Each step starts from empty in-process tiers; the persistent ones are the step's ``options``. ``train``
(default False) runs a training step: two graphs, forward and backward.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Any

import torch

from tests.workload import check_model
from tpucompile import artifacts, driver
from tpucompile.artifacts import executables
from tpucompile.config import Options
from tpucompile.metrics import compile_stats


def _wait_at_gate(signals: pathlib.Path, gate: str, timeout: float = 180) -> None:
    (signals / f"at-{gate}-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while not (signals / gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.01)


def _recorded_compiles(signals: pathlib.Path, name: str, delay: float, started: list[float]) -> None:
    """Note when each XLA compile of the step starts; with a ``delay``, mark it and sleep first."""
    compile_now = executables.compile_module

    def compile_module(*args: Any, **kwargs: Any) -> Any:
        started.append(time.time())
        if delay:
            (signals / f"compiling-{name}-{os.getpid()}").touch()
            time.sleep(delay)
        return compile_now(*args, **kwargs)

    executables.compile_module = compile_module


def run_step(signals: pathlib.Path, step: dict[str, Any]) -> dict[str, Any]:
    artifacts.clear_memory()
    torch._dynamo.reset()
    compile_stats.reset()
    events: list = []
    remove = driver.add_observer(events.append)
    compile_now = executables.compile_module
    compiles_started: list[float] = []
    _recorded_compiles(signals, step["name"], float(step.get("compile_delay", 0)), compiles_started)
    gate = step.get("gate")
    if gate:
        _wait_at_gate(signals, gate)
    start = time.monotonic()
    try:
        ok = check_model(step.get("scale", 1), step.get("train", False), step["options"])
    finally:
        executables.compile_module = compile_now
        remove()
    cache = artifacts.stores.persistent_cache(Options.from_sources(step["options"]))
    described = cache.describe() if cache is not None else {}
    return {
        "name": step["name"],
        "ok": ok,
        "seconds": time.monotonic() - start,
        "events": [{"name": e.name, "key": e.key, "tier": e.tier} for e in events],
        "compiles_started": compiles_started,
        "stats": compile_stats.snapshot()["total"],
        "remote": described.get("remote"),
        "fleet": described.get("fleet"),
    }


def main() -> None:
    plan = json.loads(pathlib.Path(sys.argv[1]).read_text())
    signals = pathlib.Path(plan["signals"])
    for step in plan["steps"]:
        print(json.dumps(run_step(signals, step)), flush=True)
    os._exit(0)  # no interpreter teardown (a second or more of CPU per host): the fleet tests start many


if __name__ == "__main__":
    main()
