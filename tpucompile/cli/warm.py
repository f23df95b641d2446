"""``tpucompile warm``: run a script with the cache on (and ``--target``s compiled and stored too), then
report hits by tier, misses and the compile time saved, and per target the step report (memory per chip by
use, whether it fits, estimated time); ``--expect-all-hits`` makes a miss an error, for CI."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tpucompile.cli.common import emit, progress_lines
from tpucompile.cli.script import run_script, script_settings
from tpucompile.config import effective_environ
from tpucompile.contracts.input_uses import BUDGET_KEY
from tpucompile.debug.step_report import format_step_report, step_report


def warm(args: argparse.Namespace) -> int:
    """Run the script with the cache on (read-write unless the environment says read-only or strict)."""
    cache_off = effective_environ().get("TPUCOMPILE_CACHE_MODE", "") in ("off", "")
    overrides = {"cache_mode": "read-write"} if cache_off else {}
    buckets = _bucket_sizes(args.buckets) if getattr(args, "buckets", None) else []
    if buckets:
        overrides.update(dynamic_mode="bucket", buckets=",".join(map(str, buckets)))
    with script_settings(args, **overrides) as targets:
        from tpucompile import driver

        events: list[Any] = []
        progress = progress_lines(args)

        def observe(event: Any) -> None:
            if progress is not None:
                progress(event)
            events.append(_without_executable(event))

        remove = driver.add_observer(observe)
        start = time.perf_counter()
        try:
            status = run_script(args.script, args.script_args)
            filled = _fill_buckets(buckets) if buckets and not status else 0
        finally:
            remove()
        seconds = time.perf_counter() - start
    target_events = [e for e in events if e.target is not None]
    events = [e for e in events if e.target is None]
    hits = [e for e in events if e.cache_hit]
    misses = [e for e in events if not e.cache_hit]
    tiers = {tier: sum(1 for e in hits if e.tier == tier) for tier in ("memory", "local", "remote")}
    document = {
        "graphs": len(events),
        "hits": len(hits),
        "hits_by_tier": tiers,
        "misses": len(misses),
        "missed": [e.name for e in misses],
        "lowering_skipped": sum(1 for e in events if e.program_tier is not None),
        "seconds_saved": round(sum(e.saved_seconds for e in hits), 3),
        "seconds_compiling": round(sum(e.compile_seconds for e in misses), 3),
        "wall_seconds": round(seconds, 3),
        "script_status": status,
        "buckets_filled": filled,
        "targets": {name: _target_report([e for e in target_events if e.target == name]) for name in targets},
    }
    text = (f"tpucompile warm: {len(events)} graphs, {len(hits)} hits "
            f"({', '.join(f'{n} {t}' for t, n in tiers.items() if n) or 'none'}), {len(misses)} misses, "
            f"{document['seconds_saved']:.2f} s saved, {document['seconds_compiling']:.2f} s compiling")
    if buckets:
        text += f"\n  buckets {','.join(map(str, buckets))}: {filled} compiled after the script to fill them"
    for name, report in document["targets"].items():
        text += (f"\n  {name}: {report['graphs']} graphs, {report['hits']} from the cache, {report['compiled']} "
                 f"compiled and stored ({report['seconds_compiling']:.2f} s), {len(report['failed'])} failed")
    for name in targets:
        step = _step_report([e for e in target_events if e.target == name], name)
        document["targets"][name]["step"] = step
        text += "\n" + format_step_report(step)
    emit(args, document, text)
    if status:
        return status
    failed = [e for e in target_events if e.error is not None]
    for event in failed:
        print(f"tpucompile warm: {event.error}", file=sys.stderr)
    if failed:
        return 1
    compiled = misses + [e for e in target_events if not e.cache_hit]
    if args.expect_all_hits and compiled:
        names = [e.name + (f" for {e.target}" if e.target else "") for e in compiled]
        print(f"tpucompile warm: --expect-all-hits, but compiled: {', '.join(names)}", file=sys.stderr)
        return 1
    return 0


def _bucket_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"tpucompile warm: --buckets takes positive sizes separated by commas, got {text!r}")
    return sizes


def _fill_buckets(sizes: list[int]) -> int:
    """Compile every bucket of every bucketed graph the script left in use; how many were compiled."""
    from tpucompile.runtime.buckets import live_graphs

    return sum(len(graph.fill(sizes)) for graph in live_graphs())


def _without_executable(event: Any) -> Any:
    """The event as ``warm`` keeps it: a target's graph counted by use now, and without the compiled executable
    (for a large model its code alone is gigabytes of host memory)."""
    import dataclasses

    from tpucompile.debug.uses import graph_uses

    uses = graph_uses(event.graph) if event.target is not None and event.graph is not None else {}
    budget = None if event.graph is None else event.graph.meta.get(BUDGET_KEY)
    return dataclasses.replace(event, executable=None, graph=None,
                               report={**(event.report or {}), "uses": uses, "activation_budget": budget})


def _step_report(events: list[Any], target: str) -> dict[str, Any]:
    graphs = [{"name": e.name, "role": e.name.rsplit("(", 1)[-1].split(")")[0] if "(" in e.name else "graph",
               "uses": (e.report or {}).get("uses", {}), "report": e.report or {},
               "error": str(e.error) if e.error is not None else None, "out_of_memory": e.out_of_memory,
               "activation_budget": (e.report or {}).get("activation_budget")}
              for e in events]
    return step_report(graphs, target)


def _target_report(events: list[Any]) -> dict[str, Any]:
    compiled = [e for e in events if not e.cache_hit and e.error is None]
    return {
        "graphs": len(events),
        "hits": sum(1 for e in events if e.cache_hit),
        "compiled": len(compiled),
        "failed": {e.name: e.error for e in events if e.error is not None},
        "seconds_compiling": round(sum(e.compile_seconds for e in compiled), 3),
        "keys": [e.key for e in events if e.key],
    }
