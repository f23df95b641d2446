"""Running a snippet in a fresh Python process, for settings that are read once per process (environment
variables read when the host kernels load)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from tests import python_processes


def run_json(script: str, env: dict[str, str], timeout: float = 300) -> Any:
    """The JSON value ``script`` prints last, run by ``python -c`` with ``env`` added to this environment."""
    done = python_processes.run([sys.executable, "-c", script], capture_output=True, text=True,
                                env={**os.environ, **env}, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
