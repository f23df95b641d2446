"""``bench/run.py`` end to end on the smallest workload: cold and warm processes, warm ones taking turns."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

_RUN = pathlib.Path(__file__).resolve().parent.parent / "bench" / "run.py"


def test_cells_take_turns_and_every_cell_is_reported(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
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
        assert 0 < cell["step_min_ms"] <= cell["step_ms"] <= cell["step_max_ms"]
        assert cell["peak_mb"] > 0
        if key.endswith("tpucompile"):
            assert cell["compile_s"] > 0 and cell["warm_start_s"] > 0
    table = out.with_suffix(".table.md").read_text()
    assert "| tpucompile | train |" in table and "geometric-mean speedup over eager" in table
