"""Reading a dump back (``dump-hlo`` without a script, ``--stage --graph``): only files, no torch, no
compiler, so the command line answers quickly."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from tpucompile.contracts.target_names import slug
from tpucompile.debug.layout import GRAPH_FOLDER, STAGES


def read_dump(root: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``info.json`` of every graph in the dump at ``root``, in compile order (empty when none)."""
    path = pathlib.Path(root)
    infos = []
    if path.is_dir():
        for child in path.iterdir():
            info_file = child / "info.json"
            if child.is_dir() and GRAPH_FOLDER.match(child.name) and info_file.is_file():
                try:
                    infos.append(json.loads(info_file.read_text()))
                except (OSError, ValueError):
                    continue
    return sorted(infos, key=lambda info: info["graph"])


def stage_text(root: str | os.PathLike[str], graph: int, stage: str, target: str | None = None) -> str:
    """The text of one stage of graph number ``graph`` (as compiled for compile-only ``target``, when one is
    named); ``LookupError`` saying why when there is none."""
    infos = {info["graph"]: info for info in read_dump(root)}
    if graph not in infos:
        have = f"graphs 0-{max(infos)}" if infos else "no graphs"
        raise LookupError(f"no graph {graph} in the dump at {root} ({have})")
    info = infos[graph]
    name = STAGES[stage]
    path = pathlib.Path(root) / info["folder"] / name
    errors = info.get("errors", {})
    if target is not None:
        report = info.get("targets", {}).get(target)
        if report is None:
            have = ", ".join(info.get("targets", {})) or "none"
            raise LookupError(f"graph {graph} was not compiled for {target} (targets in this dump: {have})")
        if stage not in ("stablehlo", "optimized"):
            raise LookupError("for a compile-only target the dump keeps the stablehlo and optimized stages")
        path = pathlib.Path(root) / info["folder"] / "targets" / slug(target) / name
        errors = {**report.get("errors", {}), **({name: report["error"]} if report.get("error") else {})}
    if not path.is_file():
        why = errors.get(name, "not recorded for this graph")
        raise LookupError(f"graph {graph} has no {stage} stage{' for ' + target if target else ''}: {why}")
    return path.read_text()
