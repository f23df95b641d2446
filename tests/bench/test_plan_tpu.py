"""``bench/plan_tpu.py`` end to end on a one-layer Llama on meta weights, FSDP over a 2x2 v5e slice: every graph
of the training step compiles for the slice, and the figures the planning section of the benchmarks page
quotes (wall time, peak host memory and its split, the step report) are written. Needs libtpu."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

from tests import python_processes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason='libtpu is not installed (pip install "tpucompile[tpu]")')
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_small_llama_step_is_planned_with_its_figures(tmp_path):
    out = tmp_path / "plan.json"
    finished = python_processes.run(
        [sys.executable, str(ROOT / "bench" / "plan_tpu.py"), "--model", "tiny", "--layers", "1",
         "--target", "tpu:v5e:2x2", "--mesh", "data=4", "--shard", "fsdp", "--batch", "4", "--length", "64",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    plan = json.loads(out.read_text())
    roles = [graph["name"].rsplit("(", 1)[-1].rstrip(")") for graph in plan["compiled"]]
    assert roles.count("forward") == 1 and roles.count("backward") == 1 and len(roles) == 3, roles
    sample = plan["peak_sample"]
    # Linux counts resident pages per thread and syncs them lazily: a sample may pass the high-water mark by a
    # few hundred KiB
    assert 0 < sample["RssAnon"] < sample["VmRSS"] <= plan["peak_host_bytes"] + 4 * 2**20, sample
    assert sample["RssFile"] > 0, sample
    report = plan["report"]
    assert report["fits"] is True and report["estimated_step_seconds"] > 0, report
    assert report["activation_budgets"]["graph 0"]["budget"] == 1.0, report  # the training graph's choice
    assert "activation budget of graph 0: 1" in finished.stdout
    assert "peak host memory" in finished.stdout and "anonymous" in finished.stdout
