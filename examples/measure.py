"""Shared by the examples: how far compiled results are from eager ones, and how long a step takes."""

from __future__ import annotations

import time
from collections.abc import Callable


def max_diff(actual, expected) -> float:
    return max((a - e).abs().max().item() for a, e in zip(actual, expected, strict=True))


def best_ms(*fns: Callable[[], object], rounds: int = 10, budget_s: float = 2.0) -> list[float]:
    """Fastest call of each function, in milliseconds, over up to ``rounds`` rounds (fewer once ``budget_s``
    is spent) that call the functions in turn, so that all of them see the same load from other processes.
    The minimum is the figure least disturbed by that load and by eager PyTorch's first slow calls."""
    times: list[list[float]] = [[] for _ in fns]
    deadline = time.perf_counter() + budget_s
    while len(times[0]) < rounds and (len(times[0]) < 2 or time.perf_counter() < deadline):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [1e3 * min(samples) for samples in times]
