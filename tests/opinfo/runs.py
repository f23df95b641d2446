"""The OpInfo sweep run in fresh processes, with a persistent cache of its own (the floor test and the warm-start
replay share one cold run)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

SWEEP = pathlib.Path(__file__).with_name("sweep.py")
FLOOR = pathlib.Path(__file__).with_name("floor.json")
GRADIENT_FLOOR = pathlib.Path(__file__).with_name("gradient_floor.json")


def sweep_env(cache_dir: pathlib.Path, mode: str) -> dict[str, str]:
    """The environment of a sweep in a fresh process: the session's settings, its own persistent cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_CACHE")}
    env.update(TPUCOMPILE_CACHE_DIR=str(cache_dir), TPUCOMPILE_CACHE_MODE=mode, TPUCOMPILE_FALLBACK="error")
    return env


def run_sweep(cache_dir: pathlib.Path, mode: str, max_samples: int, out: pathlib.Path, grad: bool = False
              ) -> list[dict]:
    """The float32 OpInfo sweep's first ``max_samples`` of every op (with ``grad``: of every op that supports
    autograd, forward and input gradients), over two processes, in fresh processes with the cache at
    ``cache_dir`` in ``mode``; every sample's outcome."""
    done = subprocess.run([sys.executable, str(SWEEP), "--max-samples", str(max_samples), "--jobs", "2",
                           "--json", str(out), "--quiet", *(["--grad"] if grad else [])],
                          capture_output=True, text=True, env=sweep_env(cache_dir, mode), timeout=1500)
    assert done.returncode == 0, f"{mode} sweep: exit code {done.returncode}\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())
