"""The example models in ``examples/`` run end to end: each ``main()`` in a fresh interpreter, exit code 0 and
its agreement and timing lines printed.

The scripts assert their own agreement with eager PyTorch (logits, losses, gradients, parameters, BatchNorm
statistics, generated tokens); here we check that they got through every check. The subprocess inherits
``TPUCOMPILE_FALLBACK=error`` from conftest, so an op without a lowering fails the example rather than running
in eager PyTorch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

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


def run_example_main(script: str) -> subprocess.CompletedProcess:
    """Import ``examples/<script>`` in a fresh interpreter and call its ``main()``."""
    module = script.removesuffix(".py")
    code = f"import sys; sys.path.insert(0, {EXAMPLES!r}); import {module}; {module}.main()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def check_example(script: str) -> None:
    result = run_example_main(script)
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


@pytest.mark.slow
@pytest.mark.parametrize("script", list(EXPECTED_LINES))
def test_example_main_runs(script):
    check_example(script)
