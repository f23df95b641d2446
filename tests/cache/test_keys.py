"""Keys are the same in every process and host that compiles the same thing, and name what they depend on."""

from __future__ import annotations

import os
import socket

import pytest

from tests.cached_runs import finish, start_workload, workload_env
from tpucompile.cache import (
    ENVIRONMENT_COMPONENTS,
    LocalStore,
    cache_key,
    canonical_json,
    decode,
    differing_components,
)
from tpucompile.runtime import build_flags, compile_options, compile_options_fingerprint, get_target


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same training step in two fresh processes with different hash seeds, cwd and cache dirs."""
    tmp_path = tmp_path_factory.mktemp("keys")
    runs = []
    for index, seed in enumerate(("0", "12345")):
        cwd = tmp_path / f"cwd{index}"
        cwd.mkdir()
        env = workload_env(tmp_path / f"cache{index}", PYTHONHASHSEED=seed)
        runs.append(start_workload(env, ["--train"], cwd=str(cwd)))
    return tmp_path, [finish(run) for run in runs]


def test_same_keys_across_processes_hash_seeds_and_directories(two_runs):
    _, (first, second) = two_runs
    assert first["ok"] and second["ok"]
    assert all(e["tier"] is None for e in first["events"] + second["events"]), "separate caches: all compiled"
    assert [e["key"] for e in first["events"]] == [e["key"] for e in second["events"]]
    assert len(first["events"]) == 2  # forward and backward


def test_plan_keys_match_across_processes_and_hold_no_paths(two_runs):
    tmp_path, _ = two_runs
    plans = []
    for index in range(2):
        store = LocalStore(tmp_path / f"cache{index}")
        entries = [decode(store.read(key), key) for key in store.list_keys()]
        plans.append({e.key: e.components for e in entries if e.kind == "plan"})
    assert len(plans[0]) == 1 and plans[0].keys() == plans[1].keys()
    text = canonical_json(next(iter(plans[0].values()))).decode()
    for private in (str(tmp_path), os.path.expanduser("~"), socket.gethostname(), os.getcwd()):
        assert private not in text, private


def test_components_hold_no_paths_hosts_or_pids(two_runs):
    tmp_path, (first, _) = two_runs
    event = first["events"][0]
    components = event["components"]
    text = canonical_json(components).decode()
    for private in (str(tmp_path), os.path.expanduser("~"), socket.gethostname(), os.getcwd()):
        assert private not in text, private
    assert cache_key(components) == event["key"]
    assert set(ENVIRONMENT_COMPONENTS) <= set(components)
    assert {"program", "inputs", "outputs", "compile_options"} <= set(components)


def test_xla_flags_in_keys_drop_dump_and_logging_flags():
    flags = build_flags({"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_dump_hlo_as_text "
                                      "--xla_cpu_enable_fast_math=true --xla_cpu_enable_fast_math=false"})
    assert flags == ["xla_cpu_enable_fast_math=false"]
    assert build_flags({}) == []


def test_compile_options_fingerprint_ignores_debug_fields():
    options = compile_options(get_target())
    baseline = compile_options_fingerprint(options)
    copy = type(options).ParseFromString(options.SerializeAsString())
    copy.executable_build_options.debug_options.xla_dump_to = "/somewhere/else"
    copy.executable_build_options.debug_options.xla_dump_hlo_as_text = True
    assert copy.SerializeAsString() != options.SerializeAsString()
    assert compile_options_fingerprint(copy) == baseline
    copy.executable_build_options.debug_options.xla_cpu_enable_fast_math = (
        not copy.executable_build_options.debug_options.xla_cpu_enable_fast_math
    )
    assert compile_options_fingerprint(copy) != baseline


def test_differing_components_names_each_difference():
    a = {"kind": "executable", "program": "1", "jaxlib": "0.10.2", "xla_flags": []}
    b = {"kind": "executable", "program": "1", "jaxlib": "0.10.3", "xla_flags": ["x=1"]}
    assert differing_components(a, b) == ["jaxlib", "xla_flags"]
    assert differing_components(a, a) == []
