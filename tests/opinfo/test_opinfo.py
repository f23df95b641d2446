"""The OpInfo floor: the float32 pass count may not drop, and no sample that passed may stop passing.

CI runs the first samples of every OpInfo (``floor.json`` says how many), in fresh processes with a cache
of their own (``opinfo_floor_sweep`` in ``tests/conftest.py``; the warm-start tests replay it); the full sweep
over every sample and dtype is
``python tests/opinfo/sweep.py --dtypes float32 bfloat16 int64 bool --markdown docs/coverage.md``.
Regenerate the floor after adding lowerings with ``python -m tests.opinfo.test_opinfo --write-floor``
(or ``--write-floor --from-json RESULTS.json`` to take it from a sweep's ``--json`` output). The gradient
floor (``gradient_floor.json``: the first sample of every OpInfo that supports autograd, forward values and
input gradients) comes from ``python tests/opinfo/sweep.py --grad --max-samples 1 --jobs 2 --json G.json`` and
``python -m tests.opinfo.test_opinfo --write-gradient-floor G.json``. The complex64 floor
(``complex_floor.json``: the first complex64 sample of every OpInfo whose dtypes include complex64) comes from
``python tests/opinfo/sweep.py --dtypes complex64 --max-samples 1 --jobs 2 --json C.json`` and
``python -m tests.opinfo.test_opinfo --write-complex-floor C.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

from tests.opinfo import sweep

FLOOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "floor.json")


def _run(max_samples: int) -> list[sweep.SampleResult]:
    warnings.filterwarnings("ignore")
    return sweep.sweep(sweep.load_op_db(), [torch.float32], max_samples)


def _passing(results: list[sweep.SampleResult]) -> set[str]:
    return {f"{r.op}|{r.dtype}|{r.index}" for r in results if r.outcome == "pass"}


@pytest.mark.slow
def test_opinfo_float32_floor(opinfo_floor_sweep):
    with open(FLOOR) as source:
        floor = json.load(source)
    results = [sweep.SampleResult(**r) for r in opinfo_floor_sweep[0] if r["index"] < floor["max_samples"]]
    passing = _passing(results)
    regressed = sorted(set(floor["passing"]) - passing)
    assert not regressed, f"{len(regressed)} samples stopped passing: {regressed[:30]}"
    assert len(passing) >= floor["min_pass"], (len(passing), floor["min_pass"])


def test_opinfo_float32_gradient_floor(tmp_path):
    """Forward values and input gradients of the first sample of every OpInfo that supports autograd."""
    from tests.opinfo.runs import GRADIENT_FLOOR, run_sweep

    floor = json.loads(GRADIENT_FLOOR.read_text())
    _assert_floor_holds(floor, run_sweep(tmp_path / "cache", "off", floor["max_samples"],
                                         tmp_path / "gradients.json", grad=True))


def test_opinfo_complex64_floor(tmp_path):
    """The first complex64 sample of every OpInfo whose dtypes include complex64: no recorded pass may stop
    passing (``complex_floor.json``)."""
    from tests.opinfo.runs import COMPLEX_FLOOR, run_sweep

    floor = json.loads(COMPLEX_FLOOR.read_text())
    _assert_floor_holds(floor, run_sweep(tmp_path / "cache", "off", floor["max_samples"],
                                         tmp_path / "complex.json", dtype="complex64"))


def _assert_floor_holds(floor: dict, outcomes: list[dict]) -> None:
    """No sample the floor records as passing stopped passing (each named with its outcome), and at least
    as many pass."""
    results = [sweep.SampleResult(**r) for r in outcomes]
    passing = _passing(results)
    regressed = sorted(set(floor["passing"]) - passing)
    reasons = {f"{r.op}|{r.index}": f"{r.outcome}: {r.detail[:200]}" for r in results
               if f"{r.op}|{r.dtype}|{r.index}" in regressed}
    assert not regressed, f"{len(regressed)} samples stopped passing: {reasons}"
    assert len(passing) >= floor["min_pass"], (len(passing), floor["min_pass"])


def write_complex_floor(from_json: str, max_samples: int = 1) -> None:
    """Record the complex64 floor from a sweep's ``--dtypes complex64 --json`` output."""
    from tests.opinfo.runs import COMPLEX_FLOOR

    _write_floor_file(COMPLEX_FLOOR, from_json, "complex64", max_samples)


def _write_floor_file(path, from_json: str, dtype: str, max_samples: int) -> None:
    with open(from_json) as source:
        results = [sweep.SampleResult(**r) for r in json.load(source)]
    results = [r for r in results if r.dtype == dtype and r.index < max_samples]
    passing = sorted(_passing(results))
    counter = sweep.summarize(results)["totals"][dtype]
    path.write_text(json.dumps({"max_samples": max_samples, "min_pass": len(passing),
                                "pass_rate": round(sweep.pass_rate(counter), 4), "passing": passing},
                               indent=0) + "\n")
    print(f"{dtype} floor: {len(passing)} passing samples, pass rate {100 * sweep.pass_rate(counter):.1f}%")


def write_gradient_floor(from_json: str, max_samples: int = 1) -> None:
    """Record the gradient floor from a sweep's ``--grad --json`` output."""
    from tests.opinfo.runs import GRADIENT_FLOOR

    _write_floor_file(GRADIENT_FLOOR, from_json, "float32+grad", max_samples)


def write_floor(max_samples: int = 2, from_json: str | None = None) -> None:
    """Record the floor from a fresh run, or from a sweep's ``--json`` output (its first samples per op)."""
    if from_json:
        with open(from_json) as source:
            results = [sweep.SampleResult(**r) for r in json.load(source)]
        results = [r for r in results if r.dtype == "float32" and r.index < max_samples]
    else:
        results = _run(max_samples)
    passing = sorted(_passing(results))
    counter = sweep.summarize(results)["totals"]["float32"]
    with open(FLOOR, "w") as out:
        json.dump({"max_samples": max_samples, "min_pass": len(passing),
                   "pass_rate": round(sweep.pass_rate(counter), 4), "passing": passing}, out, indent=0)
        out.write("\n")
    print(f"floor: {len(passing)} passing float32 samples, pass rate {100 * sweep.pass_rate(counter):.1f}%")


if __name__ == "__main__":
    if "--write-gradient-floor" in sys.argv:
        write_gradient_floor(sys.argv[sys.argv.index("--write-gradient-floor") + 1])
    elif "--write-complex-floor" in sys.argv:
        write_complex_floor(sys.argv[sys.argv.index("--write-complex-floor") + 1])
    elif "--write-floor" in sys.argv:
        source = sys.argv[sys.argv.index("--from-json") + 1] if "--from-json" in sys.argv else None
        write_floor(from_json=source)
