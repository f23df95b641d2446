"""The example models in ``examples/`` run end to end: each ``main()`` in a fresh interpreter, exit code 0 and
its agreement and timing lines printed.

The scripts assert their own agreement with eager PyTorch (logits, losses, gradients, parameters, BatchNorm
statistics, generated tokens); here we check that they got through every check. The subprocess inherits
``TPUCOMPILE_FALLBACK=error`` from conftest, so an op without a lowering fails the example rather than running
in eager PyTorch. Where libtpu is installed, the same run also compiles every graph for a v5e slice of 2 by 2
chips (compile-only, no TPU here) into a dump, and each graph's TPU executable is checked: TPU tiled layouts
in its optimised HLO, and memory per chip that adds up and fits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import python_processes

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

# Lines (prefixes, in order) each example must print; every "max |compiled - eager| = X" is also checked.
EXPECTED_LINES = {
    "resnet.py": [
        "inference: logits (8, 10), max |compiled - eager| = ",
        "train step: loss eager ",
        "train step: max gradient difference = ",
        "train step: max parameter difference after the SGD step = ",
        "train step: max BatchNorm running-stat difference = ",
        "inference after the step: max |compiled - eager| = ",
        "step time: eager ",
    ],
    "densenet.py": [
        "inference: logits (4, 10), max |compiled - eager| = ",
        "train step: loss eager ",
        "train step: max gradient difference = ",
        "train step: max BatchNorm running-stat difference = ",
        "step time: eager ",
    ],
    "unet.py": [
        "inference: logits (4, 4, 32, 32), max |compiled - eager| = ",
        "train step: loss eager ",
        "train step: max gradient difference = ",
        "train step: max parameter difference after the SGD step = ",
        "train step: max BatchNorm running-stat difference = ",
        "step time: eager ",
    ],
    "dlrm.py": [
        "inference: logits (32,), max |compiled - eager| = ",
        "inference, another batch (bag ids per table ",
        "train step: loss eager ",
        "train step: max gradient difference = ",
        "train step: max parameter difference after the SGD step = ",
        "step time: eager ",
    ],
    "llama.py": [
        "step 0: loss eager ",
        "step 0: max gradient difference = ",
        "step 2: loss eager ",
        "max parameter difference after 3 AdamW steps: ",
        "inference (prefill + 23 decode steps): max |compiled - eager| logits = ",
        "generation: 24 tokens x 2 sequences, identical tokens: True",
        "step time: eager ",
        "decode time per token: eager ",
    ],
    "qwen.py": [
        "inference: logits (4, 32, 256), max |compiled - eager| = ",
        "step 0: loss eager ",
        "step 0: max gradient difference = ",
        "step 1: loss eager ",
        "max parameter difference after 2 AdamW steps: ",
        "step time: eager ",
    ],
}

_DIFF = re.compile(r"max \|compiled - eager\|(?: logits)? = ([0-9.e+-]+)")
_STEP_TIME = re.compile(r"^step time: eager [0-9.]+ ms, tpucompile [0-9.]+ ms", re.M)


TPU_TARGET = "tpu:v5e:2x2"
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def run_example_main(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Import ``examples/<script>`` in a fresh interpreter and call its ``main()``."""
    module = script.removesuffix(".py")
    code = f"import sys; sys.path.insert(0, {EXAMPLES!r}); import {module}; {module}.main()"
    return python_processes.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                                env={**os.environ, **(env or {})})


def check_tpu_dump(script: str, dump: pathlib.Path) -> None:
    """Every graph of the run was compiled for the TPU target: tiled TPU layouts, memory per chip that adds up."""
    folders = sorted(p for p in dump.iterdir() if p.is_dir())
    assert folders, f"{script}: nothing dumped"
    for folder in folders:
        report = json.loads((folder / "info.json").read_text())["targets"][TPU_TARGET]
        assert report["error"] is None and report["fits"], (script, folder.name, report["error"])
        optimized = (folder / "targets" / "tpu-v5e-2x2" / "hlo_optimized.txt").read_text()
        assert re.search(r"\{[0-9,]+:T\(\d+(,\d+)?\)", optimized), f"{script} {folder.name}: no TPU tiled layout"
        memory = report["memory"]
        assert memory["argument"] > 0 and memory["generated_code"] > 0 and report["flops"] >= 0
        assert 0 < memory["peak"] < report["hbm_bytes"] == int(15.75 * 2**30)


def check_example(script: str, dump: pathlib.Path | None = None) -> None:
    env = {"TPUCOMPILE_TARGETS": TPU_TARGET, "TPUCOMPILE_DUMP_DIR": str(dump)} if dump is not None else None
    result = run_example_main(script, env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    position = 0
    for prefix in EXPECTED_LINES[script]:
        found = next((i for i in range(position, len(lines)) if lines[i].startswith(prefix)), None)
        assert found is not None, f"{script}: no line starting {prefix!r} (in order) in:\n{result.stdout}"
        position = found + 1
    diffs = [float(value) for value in _DIFF.findall(result.stdout)]
    assert diffs and max(diffs) < 1e-4, f"{script}: compiled vs eager differences {diffs}"
    assert _STEP_TIME.search(result.stdout), result.stdout
    assert "TPU_ACCELERATOR_TYPE" not in result.stderr  # libtpu's start-up noise is not the user's business
    if dump is not None:
        check_tpu_dump(script, dump)


@pytest.mark.slow
@pytest.mark.parametrize("script", list(EXPECTED_LINES))
def test_example_main_runs(script, tmp_path):
    check_example(script, tmp_path / "dump" if HAS_LIBTPU else None)
