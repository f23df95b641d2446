"""Helpers shared by the cache tests: fresh-process workloads, free ports, clean in-process tiers, the size of
fault-injection loops and the payloads whose every byte a reader can check."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tests import python_processes

WORKLOAD = pathlib.Path(__file__).with_name("workload.py")
FULL_FAULTS_FLAG = "TPUCOMPILE_FULL_FAULTS"


def fault_repetitions(reduced: int, full: int) -> int:
    """How many times a fault-injection loop runs: ``reduced`` by default (CI's time budget), ``full`` when
    ``$TPUCOMPILE_FULL_FAULTS=1`` (the figures docs/reliability.md states come from a full run)."""
    return full if os.environ.get(FULL_FAULTS_FLAG) == "1" else reduced


def report(name: str, **figures: Any) -> None:
    """Print a fault test's figures on one line (``pytest -s`` shows them; docs/reliability.md quotes them)."""
    print(f"\nreliability: {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def entry_payload(seed: str, n: int, largest: int = 3 << 20) -> bytes:
    """The payload of entry ``n`` of writer ``seed``: random bytes, yet reproducible, so a reader can tell a
    served entry's bytes from anything else without trusting the cache's own checks."""
    rng = random.Random(f"{seed}:{n}")
    return rng.randbytes(rng.randrange(1, largest))


def workload_env(cache_dir: pathlib.Path | str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_CACHE")}
    env["TPUCOMPILE_CACHE_DIR"] = str(cache_dir)
    env.update(extra)
    return env


def start_workload(env: Mapping[str, str], args: Sequence[str] = (), cwd: str | None = None) -> subprocess.Popen:
    return python_processes.popen(
        [sys.executable, str(WORKLOAD), *args], env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 180) -> dict[str, Any]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"workload failed ({process.returncode}):\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def run_workload(env: Mapping[str, str], args: Sequence[str] = (), cwd: str | None = None) -> dict[str, Any]:
    return finish(start_workload(env, args, cwd))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis_server(folder: pathlib.Path) -> tuple[subprocess.Popen, str] | None:
    """A throwaway ``redis-server`` on a free local port (no persistence, files under ``folder``) once it
    accepts connections, and its URL; None when redis-server or redis-py is not installed."""
    binary = shutil.which("redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        return None
    if binary is None:
        return None
    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return server, f"redis://127.0.0.1:{port}/0"


def executable_events(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(result["events"])


@contextlib.contextmanager
def fresh_start() -> Iterator[list]:
    """A fresh start as far as this process is concerned (tpucompile's in-memory tiers and Dynamo's caches
    emptied; only persistent tiers stay warm); yields the list that collects tpucompile's compile events."""
    import torch

    from tpucompile import artifacts, driver

    artifacts.clear_memory()
    torch._dynamo.reset()
    events: list = []
    remove = driver.add_observer(events.append)
    try:
        yield events
    finally:
        remove()


def compile_and_run(fn, *inputs, **options):
    """Compile ``fn`` with tpucompile in this process (in-memory tiers emptied first); return (result,
    events). Persistent tiers are whatever the environment and ``options`` say."""
    import torch

    with fresh_start() as events:
        compiled = torch.compile(fn, backend="tpucompile", fullgraph=True, options=options or None)
        result = compiled(*inputs)
    return result, events
