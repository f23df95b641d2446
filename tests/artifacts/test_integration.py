"""The backend with the persistent tiers: warm starts skip lowering and compiling; bad entries are recompiled."""

from __future__ import annotations

import random

import pytest
import torch

from tests.cached_runs import compile_and_run
from tpucompile import CacheMissError, artifacts
from tpucompile.cache import LocalStore, decode


def f(x, y):
    return torch.tanh(x @ y) * 2 + 1


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4, generator=generator), torch.randn(4, 5, generator=generator)


def test_warm_start_loads_program_and_executable_from_disk(cache_dir):
    x, y = _inputs()
    expected = f(x, y)
    first, (cold,) = compile_and_run(f, x, y)
    second, (warm,) = compile_and_run(f, x, y)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert cold.tier is None and cold.program_tier is None
    assert warm.tier == "local" and warm.program_tier == "local"
    assert warm.key == cold.key and warm.cache_hit
    # the program read back carries the user's source locations, like a freshly lowered one
    assert warm.program.text(debug_info=True) == cold.program.text(debug_info=True)
    kinds = sorted(decode(LocalStore(cache_dir).read(k), k).kind for k in LocalStore(cache_dir).list_keys())
    assert kinds == ["executable", "plan", "program"]


def test_random_corruption_of_entries_is_detected_and_recompiled(cache_dir):
    x, y = _inputs(1)
    expected = f(x, y)
    compile_and_run(f, x, y)
    store = LocalStore(cache_dir)
    rng = random.Random(3)
    for _ in range(6):
        for key in list(store.list_keys()):
            path = store.path(key)
            data = bytearray(path.read_bytes())
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
        result, (event,) = compile_and_run(f, x, y)
        torch.testing.assert_close(result, expected)
        assert event.tier is None and event.program_tier is None, "corrupt entries are never served"
    quarantined = [p for p in store.quarantine_dir.iterdir() if p.suffix != ".why"]
    assert len(quarantined) == 18  # six rounds of a plan, a program and an executable entry


def test_strict_mode_refuses_to_compile_and_names_graph_and_key(cache_dir):
    x, y = _inputs()
    with pytest.raises(Exception) as info:
        compile_and_run(f, x, y, cache_mode="strict")
    message = str(info.value)
    assert "CacheMissError" in message or isinstance(info.value, CacheMissError)
    assert "graph 0 (inference)" in message or "graph" in message
    assert "strict" in message
    # after warming, strict mode runs from the cache
    compile_and_run(f, x, y)
    result, (event,) = compile_and_run(f, x, y, cache_mode="strict")
    torch.testing.assert_close(result, f(x, y))
    assert event.tier == "local"


def test_strict_mode_message_holds_the_key(cache_dir):
    x, y = _inputs()
    keys = []
    from tpucompile import driver

    remove = driver.add_observer(lambda e: keys.append(e.key))
    try:
        compile_and_run(f, x, y)
    finally:
        remove()
    artifacts.clear_memory()
    store = LocalStore(cache_dir)
    for key in list(store.list_keys()):
        store.delete(key)
    with pytest.raises(Exception) as info:
        compile_and_run(f, x, y, cache_mode="strict")
    assert keys[0] in str(info.value)


def test_read_only_mode_never_writes(cache_dir):
    x, y = _inputs()
    result, (event,) = compile_and_run(f, x, y, cache_mode="read-only")
    torch.testing.assert_close(result, f(x, y))
    assert event.tier is None
    assert not cache_dir.exists() or not list(LocalStore(cache_dir, create=False).list_keys())


def test_off_mode_keeps_nothing_on_disk(cache_dir):
    x, y = _inputs()
    compile_and_run(f, x, y, cache_mode="off")
    assert not cache_dir.exists()


def test_miss_log_names_the_nearest_differing_components(cache_dir, caplog):
    x, y = _inputs()
    compile_and_run(f, x, y, host_kernels="off")  # the measured host-kernel choice of a product would differ too
    import logging

    with caplog.at_level(logging.DEBUG, logger="tpucompile"):
        compile_and_run(f, torch.randn(6, 4), y, host_kernels="off")
    (line,) = [r.getMessage() for r in caplog.records if "cache miss" in r.getMessage()]
    assert "differs in: inputs, outputs, program" in line, line


def test_read_only_mode_serves_hits_without_touching_the_directory(cache_dir):
    x, y = _inputs()
    compile_and_run(f, x, y)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in cache_dir.rglob("*") if p.is_file())
    result, (event,) = compile_and_run(f, x, y, cache_mode="read-only")
    torch.testing.assert_close(result, f(x, y))
    assert event.tier == "local" and event.program_tier == "local"
    after = sorted((p.name, p.stat().st_mtime_ns) for p in cache_dir.rglob("*") if p.is_file())
    assert before == after


def unique_rows(x):
    return torch.unique(x, dim=0, return_counts=True)


def test_warm_start_keeps_the_padding_plan_of_data_dependent_sizes(cache_dir):
    x = torch.tensor([[1.0, 2.0], [0.0, 1.0], [1.0, 2.0]])
    expected = unique_rows(x)
    _, cold_events = compile_and_run(unique_rows, x)
    warm, warm_events = compile_and_run(unique_rows, x)
    assert [e.program_tier for e in warm_events] == ["local"] * len(cold_events)
    for actual, wanted in zip(warm, expected, strict=True):
        torch.testing.assert_close(actual, wanted)
