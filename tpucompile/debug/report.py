"""The summary tables of a dump: one row per graph, then per compile-only target the memory per chip and
whether it fits, and the step report. Printed by ``dump-hlo`` and kept in the dump's ``summary.txt``; works on
``info.json`` documents alone."""

from __future__ import annotations

from typing import Any

from tpucompile.debug.step_report import format_step_report, step_report


def format_summary(infos: list[dict[str, Any]]) -> str:
    """One row per graph: what it is, how big, what it takes and returns, its key and how it was compiled."""
    header = ["graph", "role", "aten ops", "hlo ops", "in/out", "shapes", "saved for bw", "key", "compile ms",
              "cache", "fallback"]
    rows = [header]
    for info in infos:
        role = info["role"] + (f" {info['region']}" if info.get("region") else "")
        cache = info["cache"] + (f" ({info['cache_tier']})" if info.get("cache_tier") else "")
        rows.append([
            str(info["graph"]), role, str(info["aten_ops"]), str(info["hlo_ops"]),
            f"{len(info['inputs'])}/{len(info['outputs'])}",
            f"{_clip_shapes(info['inputs'])} -> {_clip_shapes(info['outputs'])}",
            _saved(info.get("saved_for_backward")), info["key"][:12], f"{info['compile_ms']:.1f}", cache,
            ",".join(info.get("fallback_ops") or []) or "-",
        ])
    steps = [format_step_report(report) for report in step_reports(infos).values()]
    return "\n".join([_table(rows, {0, 2, 3, 8}), *_target_summaries(infos), *(["", *steps] if steps else [])])


def step_reports(infos: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per compile-only target, the step report of the dumped graphs (``step_report``)."""
    names = list(dict.fromkeys(t for info in infos for t in info.get("targets", {})))
    return {name: step_report([{"name": info["name"], "role": info["role"], "uses": info.get("uses_per_chip") or {},
                                "report": info["targets"][name], "error": info["targets"][name].get("error"),
                                "out_of_memory": info["targets"][name].get("fits") is False,
                                "activation_budget": info.get("activation_budget")}
                               for info in infos if name in info.get("targets", {})], name) for name in names}


def _saved(saved: dict[str, int] | None) -> str:
    """A backward's saved values: the activations its forward computed, + the forward inputs it also reads."""
    if not saved:
        return "-"
    return f"{_bytes(saved['activations'])} + {_bytes(saved['arguments'])} in"


def _table(rows: list[list[str]], numeric: set[int]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _target_summaries(infos: list[dict[str, Any]]) -> list[str]:
    """Per compile-only target: each graph's memory per chip by use, flops and whether it fits the chip,
    then why any graph does not compile for it."""
    names = list(dict.fromkeys(t for info in infos for t in info.get("targets", {})))
    blocks = []
    for name in names:
        reports = [(info, info["targets"][name]) for info in infos if name in info.get("targets", {})]
        hbm = next((r["hbm_bytes"] for _, r in reports if r.get("hbm_bytes")), None)
        title = f"{name}: memory per chip" + (f" (of {hbm / 2**30:.2f} GiB HBM)" if hbm else "")
        rows = [["graph", "role", "arguments", "outputs", "temporaries", "code", "peak", "flops", "fits",
                 "compile ms", "cache"]]
        failures = []
        for info, report in reports:
            memory = report.get("memory") or {}
            role = info["role"] + (f" {info['region']}" if info.get("region") else "")
            cells = [_bytes(memory.get(k)) for k in ("argument", "output", "temp", "generated_code", "peak")]
            rows.append([str(info["graph"]), role, *cells, _count(report.get("flops")),
                         _fits(report, memory.get("peak"), hbm), f"{report.get('compile_ms', 0):.1f}",
                         report.get("cache", "-") + (f" ({report['cache_tier']})" if report.get("cache_tier") else "")])
            if report.get("error"):
                failures.append(f"  graph {info['graph']}: {report['error']}")
        blocks.append("\n".join([title, _table(rows, {0, 2, 3, 4, 5, 6, 7, 9}), *failures]))
    return ["", *blocks] if blocks else []


def _fits(report: dict[str, Any], peak: int | None, hbm: int | None) -> str:
    if report.get("fits") is False:
        return "NO"
    if report.get("error"):
        return "-"
    if peak and hbm:
        share = 100 * peak / hbm
        return ("NO" if share > 100 else f"yes ({share:.1f}%)" if share >= 0.1 else "yes (<0.1%)")
    return "yes"


def _bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _count(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f}"


def _clip_shapes(specs: list[str], shown: int = 1) -> str:
    if not specs:
        return "()"
    text = " ".join(specs[:shown])
    return text + (f" +{len(specs) - shown}" if len(specs) > shown else "")
