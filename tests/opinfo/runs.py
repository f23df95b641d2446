"""The OpInfo sweep run in fresh processes, with a persistent cache of its own (the floor test and the warm-start
replay share one cold run)."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from tests.opinfo import sweep

FLOOR = pathlib.Path(__file__).with_name("floor.json")
GRADIENT_FLOOR = pathlib.Path(__file__).with_name("gradient_floor.json")
COMPLEX_FLOOR = pathlib.Path(__file__).with_name("complex_floor.json")


def sweep_env(cache_dir: pathlib.Path, mode: str) -> dict[str, str]:
    """The environment of a sweep in a fresh process: the session's settings, its own persistent cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_CACHE")}
    env.update(TPUCOMPILE_CACHE_DIR=str(cache_dir), TPUCOMPILE_CACHE_MODE=mode, TPUCOMPILE_FALLBACK="error")
    return env


def run_sweep(cache_dir: pathlib.Path, mode: str, max_samples: int, out: pathlib.Path, grad: bool = False,
              dtype: str = "float32") -> list[dict]:
    """The OpInfo sweep's first ``max_samples`` of every op in ``dtype`` (with ``grad``: float32, of every op
    that supports autograd, forward and input gradients), over two fresh processes started from here, with
    the cache at ``cache_dir`` in ``mode``; every sample's outcome, also written to ``out``."""
    argv = ["--max-samples", str(max_samples), "--dtypes", dtype, *(["--grad"] if grad else [])]
    try:
        results = sweep.run_in_processes(argv, 2, env=sweep_env(cache_dir, mode), timeout=1500,
                                           capture=True)
    except SystemExit as failure:
        raise AssertionError(f"{mode} sweep: {failure}") from None
    sweep.write_json(results, out)
    return [dataclasses.asdict(r) for r in results]
