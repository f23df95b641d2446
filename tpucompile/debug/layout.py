"""The dump's folder and file names: the recorder writes by them and the readers look for them, so they are
spelled once, here."""

from __future__ import annotations

import re

ENV_VAR = "TPUCOMPILE_DUMP_DIR"
DEFAULT_DIR = "tpucompile_dump"
STAGES = {
    "fx": "fx.txt",
    "aten": "aten.txt",
    "stablehlo": "stablehlo.mlir",
    "hlo": "hlo.txt",
    "optimized": "hlo_optimized.txt",
}
"""``--stage`` name → the file holding that stage in a graph's folder."""

GRAPH_FOLDER = re.compile(r"^\d{3,}-[a-z]")
"""The name of one graph's folder (``000-forward``, ``002-backward-fused_0``)."""
