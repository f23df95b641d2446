"""Dynamo as the test processes run it."""

from __future__ import annotations


def skip_guard_latency_profiling() -> None:
    """Dynamo times each new set of guards once, after flushing the CPU caches, for its compile metrics
    (``guard_latency_us``): about 20 ms a compile, a sixth of an OpInfo sample's time. Nothing here reads that
    metric, and the tests compile thousands of small graphs; the guards themselves are built and checked as
    before."""
    import torch._dynamo.guards as guards

    guards.profile_guard_manager = lambda *args, **kwargs: 0.0
