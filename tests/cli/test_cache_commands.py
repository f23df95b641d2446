"""``tpucompile cache …`` and ``tpucompile warm`` (mostly in-process through ``cli.main``)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import python_processes
from tests.cached_runs import WORKLOAD, workload_env
from tpucompile import cli
from tpucompile.cache import Entry, PersistentCache


def _run(capsys, *argv: str) -> tuple[int, dict]:
    status = cli.main([*argv, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out)


@pytest.fixture
def filled(tmp_path):
    cache = PersistentCache(tmp_path)
    a = Entry.create({"kind": "executable", "program": "1" * 64, "jaxlib": "0.10.2", "xla_flags": []},
                     b"a" * 5000, {}, 2.0)
    b = Entry.create({"kind": "executable", "program": "1" * 64, "jaxlib": "0.10.3", "xla_flags": ["x=1"]},
                     b"b" * 9000, {}, 0.1)
    cache.put(a)
    cache.put(b)
    return tmp_path, cache, a, b


def test_ls_stats_verify(filled, capsys):
    directory, cache, a, b = filled
    status, listing = _run(capsys, "cache", "ls", "--dir", str(directory))
    assert status == 0 and {e["key"] for e in listing["entries"]} == {a.key, b.key}
    status, stats = _run(capsys, "cache", "stats", "--dir", str(directory))
    assert stats["entries"] == 2 and stats["by_kind"]["executable"]["entries"] == 2
    status, verify = _run(capsys, "cache", "verify", "--dir", str(directory))
    assert status == 0 and verify["ok"] == 2
    path = cache.local.path(b.key)
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    status, verify = _run(capsys, "cache", "verify", "--dir", str(directory))
    assert status == 1 and list(verify["corrupt"]) == [b.key]
    assert not path.exists()


def test_explain_names_differing_components(filled, capsys):
    directory, _, a, b = filled
    status, explained = _run(capsys, "cache", "explain", a.key, b.key[:12], "--dir", str(directory))
    assert status == 0
    assert explained["differing"] == ["jaxlib", "xla_flags"]
    assert explained["details"]["jaxlib"] == {"a": "0.10.2", "b": "0.10.3"}
    assert cli.main(["cache", "explain", a.key, b.key, "--dir", str(directory)]) == 0
    assert "jaxlib" in capsys.readouterr().out


def test_prune_to_size(filled, capsys):
    directory, cache, a, b = filled
    status, pruned = _run(capsys, "cache", "prune", "--max-size", "6KB", "--dir", str(directory))
    assert status == 0 and pruned["evicted"] == [b.key] and pruned["bytes_after"] <= 6000
    assert cache.local.contains(a.key) and not cache.local.contains(b.key)


def test_unknown_key_is_an_error_not_a_crash(filled, capsys):
    directory, *_ = filled
    assert cli.main(["cache", "explain", "ffff", "eeee", "--dir", str(directory)]) == 1
    assert "matches 0" in capsys.readouterr().out


def test_warm_reports_hits_and_expect_all_hits(tmp_path):
    env = workload_env(tmp_path / "cache")
    command = [sys.executable, "-m", "tpucompile", "warm", "--json", "--expect-all-hits", str(WORKLOAD)]
    cold = python_processes.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert cold.returncode == 1, cold.stderr[-2000:]
    assert "expect-all-hits" in cold.stderr
    warm = python_processes.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert warm.returncode == 0, warm.stderr[-2000:]
    report = json.loads(warm.stdout[warm.stdout.index("{\n"):])
    assert report["misses"] == 0 and report["hits"] == 1 and report["hits_by_tier"]["local"] == 1
    assert report["lowering_skipped"] == 1 and report["seconds_saved"] > 0


def test_commands_that_run_a_script_configure_it_without_touching_os_environ(tmp_path, monkeypatch, capsys):
    """``warm`` and ``dump-hlo`` hand ``--dir`` and ``--target`` to the script they run in this process for as
    long as it runs; its ``TPUCOMPILE_*`` variables are the same before, during and after, and no variable
    changes (importing jax and libtpu the first time adds variables of their own, which is not the CLI)."""
    monkeypatch.delenv("TPUCOMPILE_CACHE_MODE", raising=False)
    monkeypatch.delenv("TPUCOMPILE_TARGETS", raising=False)
    monkeypatch.delenv("TPUCOMPILE_HOST_KERNEL_TIMING", raising=False)
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\n"
        "from tpucompile.config import Options\n"
        "o = Options.from_sources()\n"
        "seen = {'cache_dir': o.cache_dir, 'cache_mode': o.cache_mode, 'targets': list(o.targets),\n"
        "        'host_kernel_timing': o.host_kernel_timing,\n"
        "        'environ': {k: v for k, v in os.environ.items() if k.startswith('TPUCOMPILE_')}}\n"
        "open(sys.argv[1], 'w').write(json.dumps(seen))\n"
    )
    before = dict(os.environ)
    ours = {k: v for k, v in before.items() if k.startswith("TPUCOMPILE_")}
    # what warm compiles is what a server loads: the host kernels chosen before the compile, not on later calls
    expected = {"cache_dir": str(tmp_path / "cache"), "cache_mode": "read-write", "targets": ["cpu"],
                "host_kernel_timing": "inline", "environ": ours}

    def unchanged() -> bool:
        now = dict(os.environ)
        return {k: v for k, v in now.items() if k.startswith("TPUCOMPILE_")} == ours and before.items() <= now.items()

    warm_seen = tmp_path / "warm.json"
    assert cli.main(["warm", "--dir", str(tmp_path / "cache"), "--target", "cpu", str(script), str(warm_seen)]) == 0
    assert unchanged()
    assert json.loads(warm_seen.read_text()) == expected

    dump_seen = tmp_path / "dump.json"
    status = cli.main(["dump-hlo", "--dir", str(tmp_path / "cache"), "--target", "cpu", str(script),
                       "--out", str(tmp_path / "dump"), "--", str(dump_seen)])
    assert status == cli.EXIT_NOTHING_COMPILED  # the probe compiles nothing; its settings were still in force
    assert unchanged()
    assert json.loads(dump_seen.read_text()) == expected
    capsys.readouterr()

    from tpucompile.config import Options

    after = Options.from_sources()
    assert after.targets == () and after.cache_dir == (os.environ.get("TPUCOMPILE_CACHE_DIR") or None)

