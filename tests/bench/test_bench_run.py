"""``bench/run.py`` end to end on the smallest workload: cold and warm processes, warm ones taking turns."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

from tests import python_processes

_RUN = pathlib.Path(__file__).resolve().parents[2] / "bench" / "run.py"


def test_cells_take_turns_and_every_cell_is_reported(tmp_path):
    out = tmp_path / "bench"
    done = python_processes.run(
        [sys.executable, str(_RUN), "--models", "mlp", "--backends", "eager,tpucompile", "--iters", "4",
         "--rounds", "2", "--warmup", "1", "--budget", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert sorted(results) == [f"mlp/{mode}/{backend}" for mode in ("inference", "train")
                               for backend in ("eager", "tpucompile")]
    for key, cell in results.items():
        assert "error" not in cell, (key, cell)
        assert cell["steps"] == 6, (key, cell)  # two turns of max(3, 4 / 2) timed steps
        assert len(cell["turn_ms"]) == 2 and all(t > 0 for t in cell["turn_ms"]), (key, cell)
        assert 0 < cell["step_min_ms"] <= cell["step_ms"] <= cell["step_max_ms"]
        assert cell["peak_mb"] > 0
        if key.endswith("tpucompile"):
            assert cell["compile_s"] > 0 and cell["warm_start_s"] > 0
    table = out.with_suffix(".table.md").read_text()
    assert "| tpucompile | train |" in table and "geometric-mean speedup over eager" in table


def test_the_host_kernels_effect_pairs_turns_of_the_same_round():
    """Drift between rounds cancels: each round's ratio is taken between the two turns that ran back to back."""
    spec = importlib.util.spec_from_file_location("bench_run", _RUN)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    with_kernels = {"turn_ms": [1.0, 2.2, 4.0]}  # the machine slows down from round to round
    without = {"turn_ms": [1.1, 2.0, 4.4]}
    assert run.paired_ratio(with_kernels, without) == "0.909 (0.909-1.100)"
    assert run.paired_ratio({"turn_ms": [1.0, math.nan]}, {"turn_ms": [2.0, 1.0]}) == "0.500 (0.500-0.500)"
    assert run.paired_ratio({}, {}) == "-"
