"""The ModuleInfo floor: PyTorch's own module database trained and run through tpucompile, against eager.

Every module of ``common_modules.module_db`` is run on its first samples in training mode (outputs, input and
parameter gradients, buffers; two samples), and on its first sample in eval mode under ``no_grad`` (its
inference fast paths) and in training mode under bfloat16 autocast. The pass count per mode may not
drop and no sample that passed may stop passing. Regenerate the floor after a fix with
``python -m tests.moduleinfo.test_moduleinfo --write-floor`` (``--from-json A.json B.json`` takes it from
sweeps' outputs); ``docs/coverage.md`` lists every sample that
does not pass and why (``python tests/moduleinfo/sweep.py --markdown ...``).
"""

from __future__ import annotations

import json
import pathlib
import sys
import warnings

import pytest
import torch

from tests.moduleinfo import sweep

FLOOR = pathlib.Path(__file__).with_name("floor.json")
RUNS = {"train float32": ("train", False, 2), "eval float32": ("eval", False, 1),
        "train float32+autocast": ("train", True, 1)}
"""The floor's runs: (mode, bfloat16 autocast, samples per module) by the key their results are summarised
under."""


def _run(key: str) -> list[sweep.SampleResult]:
    mode, autocast, max_samples = RUNS[key]
    warnings.filterwarnings("ignore")
    return sweep.sweep(sweep.load_module_db(), [mode], torch.float32, max_samples, autocast=autocast)


def _passing(results: list[sweep.SampleResult]) -> set[str]:
    return {f"{r.module}|{r.mode}|{r.dtype}|{r.index}" for r in results if r.outcome == "pass"}


@pytest.mark.parametrize("key", list(RUNS))
def test_moduleinfo_floor(key):
    floor = json.loads(FLOOR.read_text())
    results = _run(key)
    passing = _passing(results)
    regressed = sorted(set(floor["runs"][key]["passing"]) - passing)
    failures = {f"{r.module}|{r.index}": f"{r.outcome}: {r.detail[:200]}" for r in results
                if f"{r.module}|{r.mode}|{r.dtype}|{r.index}" in regressed}
    assert not regressed, f"{len(regressed)} samples stopped passing: {failures}"
    assert len(passing) >= floor["runs"][key]["min_pass"], (len(passing), floor["runs"][key]["min_pass"])


def write_floor(from_json: list[str] = ()) -> None:
    """Record the floor from fresh runs, or from sweeps' ``--json`` outputs (their first samples per module)."""
    loaded = [sweep.SampleResult(**r) for name in from_json for r in json.loads(pathlib.Path(name).read_text())]
    runs = {}
    for key in RUNS:
        results = ([r for r in loaded if f"{r.mode} {r.dtype}" == key and r.index < RUNS[key][2]] if from_json
                   else _run(key))
        passing = sorted(_passing(results))
        counter = sweep.summarize(results)[key]
        runs[key] = {"min_pass": len(passing), "pass_rate": round(sweep.pass_rate(counter), 4), "outcomes": counter,
                     "passing": passing}
        print(f"{key}: {counter}, pass rate {100 * sweep.pass_rate(counter):.1f}%")
    FLOOR.write_text(json.dumps({"runs": runs}, indent=0) + "\n")


if __name__ == "__main__":
    if "--write-floor" in sys.argv:
        write_floor(from_json=sys.argv[sys.argv.index("--from-json") + 1:] if "--from-json" in sys.argv else ())
