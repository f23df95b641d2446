"""The step report of a compile-only target: what one training step holds per chip, by use, whether it fits
the chip's HBM, and how long XLA's TPU compiler expects it to take; what ``dump-hlo --target`` and ``warm
--target`` print for planning a TPU job on a machine without one.

Per-chip bytes by use come from the ATen graphs (``uses``); temporaries and each program's peak from XLA's
memory statistics of the target's compile. The step's peak is an estimate: the largest of each program's peak
plus what stays resident outside it (the optimiser state, while the forward and backward run). Each training
graph's activation budget, and why it was chosen, comes with its forward (``frontend/activation_budget.py``).
Pure Python, so that reading a dump stays quick.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpucompile.contracts.input_uses import (
    ACTIVATIONS,
    GRADIENTS,
    INPUTS,
    OPTIMIZER_STATE,
    PARAMETERS,
    RETURNED_GRADIENTS,
)
from tpucompile.contracts.target_names import GENERATIONS
from tpucompile.contracts.target_names import parse as parse_target


def step_report(graphs: Sequence[dict[str, Any]], target: str) -> dict[str, Any]:
    """One step's report for ``target`` from its graphs, each ``{"name", "role", "uses", "report"}`` (the
    target's compile report: ``memory``, ``flops``, ``bytes_accessed``, ``optimal_seconds``), with ``error``
    and ``out_of_memory`` for a graph the target did not compile."""
    compiled = [g for g in graphs if g.get("report") and g["report"].get("memory") and not g.get("error")]
    failed = [g for g in graphs if g not in compiled]
    out_of_memory = any(g.get("out_of_memory") or (g.get("report") or {}).get("fits") is False for g in failed)
    # bytes by use come from the graphs' shardings: counted for the graphs that did not compile too
    steps = [g for g in graphs if g["role"] == "inference" and (g["uses"].get(GRADIENTS) or
                                                                g["uses"].get(OPTIMIZER_STATE))]
    forwards = [g for g in graphs if g["role"] == "forward"] or [g for g in graphs if g not in steps]
    backwards = [g for g in graphs if g["role"] == "backward"]
    total = {
        PARAMETERS: max(_sum(forwards, PARAMETERS), _sum(steps, PARAMETERS)),
        GRADIENTS: max(_sum(backwards, RETURNED_GRADIENTS), _sum(steps, GRADIENTS)),
        OPTIMIZER_STATE: _sum(steps, OPTIMIZER_STATE),
        ACTIVATIONS: _sum(backwards, ACTIVATIONS),
        INPUTS: _sum(forwards, INPUTS),
        "temporaries": max((g["report"]["memory"].get("temp", 0) for g in compiled), default=0),
    }
    outside = {id(g): total[OPTIMIZER_STATE] for g in forwards + backwards}  # resident while they run
    peak = max((g["report"]["memory"].get("peak", 0) + outside.get(id(g), 0) for g in compiled), default=0)
    generation = _generation(target)
    hbm = generation.hbm_bytes if generation else None
    estimates = [_program_seconds(g["report"], generation) for g in compiled]
    seconds = sum(time or 0.0 for time, _ in estimates)
    bounds = [_roofline_seconds(g["report"], generation) for g in compiled]
    bound = sum(bounds) if bounds and None not in bounds else None
    flops = sum(g["report"].get("flops") or 0 for g in compiled)
    complete = bool(compiled) and not failed and all(time is not None for time, _ in estimates)
    return {
        "target": target,
        "graphs": [{"name": g["name"], "role": g["role"], "memory": g["report"]["memory"],
                    "flops": g["report"].get("flops"), "estimated_seconds": time, "estimated_by": how}
                   for g, (time, how) in zip(compiled, estimates, strict=True)],
        "failed": {g["name"]: g.get("error") or "not compiled" for g in failed},
        "bytes_per_chip": total,
        "peak_per_chip": peak,
        "hbm_per_chip": hbm,
        "fits": False if out_of_memory else None if hbm is None or failed else peak <= hbm,
        "suggestion": _suggestion(total, peak, hbm),
        "margin_bytes": None if hbm is None else hbm - peak,
        "estimated_step_seconds": seconds if complete else None,
        "estimated_by": sorted({how for _, how in estimates}),
        "flops_per_chip": flops,
        "rolled_loops": any(g["report"].get("loop_flops_added") for g in compiled),
        "estimated_mfu": (flops / (seconds * generation.peak_bf16_flops)
                          if complete and seconds > 0 and generation else None),
        "roofline_step_seconds": bound if complete else None,
        "roofline_mfu": flops / (bound * generation.peak_bf16_flops) if complete and bound and generation else None,
        "activation_budgets": {g["name"].rsplit(" (", 1)[0]: g["activation_budget"] for g in forwards
                               if g.get("activation_budget")},
    }


def _suggestion(total: dict[str, int], peak: int, hbm: int | None) -> str | None:
    """For a step that does not fit: what it spends the chip's memory on, and the mesh that would fit it."""
    if hbm is None or peak <= hbm:
        return None
    split = sum(total[use] for use in (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS))
    rest = peak - split
    spent = ", ".join(f"{use.replace('_', ' ')} {total[use] / 2**30:.2f} GiB"
                      for use in (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, ACTIVATIONS, "temporaries"))
    text = f"needs {peak / 2**30:.2f} GiB per chip of {hbm / 2**30:.2f} GiB ({spent})"
    if rest >= hbm:
        return (text + "; what no data axis splits (temporaries, code) alone exceeds the chip: lower the batch per "
                "chip or the activation_memory_budget option")
    factor = 2
    while rest + split / factor > hbm:
        factor *= 2
    return (text + f"; under fully_sharded the parameters, gradients, optimiser state and activations divide by "
            f"the data axis: a data axis {factor}x larger at the same global batch (more chips, or fewer on the "
            f"model axis; the batch must divide over it) would need about {(rest + split / factor) / 2**30:.2f} GiB, "
            f"or save fewer activations for the backward (a lower activation_memory_budget option)")


def _sum(graphs: Sequence[dict[str, Any]], use: str) -> int:
    return sum(g["uses"].get(use, 0) for g in graphs)


def _generation(target: str) -> Any:
    generation = parse_target(target).generation
    return None if generation is None else GENERATIONS[generation]


def _program_seconds(report: dict[str, Any], generation: Any) -> tuple[float | None, str]:
    """XLA's own estimate (``optimal_seconds``) where it gives one that the chip could meet; otherwise the
    compiler's per-instruction cycle estimates at the chip's clock, no overlap assumed; otherwise the roofline
    bound. XLA's estimate was seen below the program's flops at the chip's peak (an 8B-shaped backward of 794
    TFLOP per chip: 0.26 s on a v5p, whose peak needs 1.73 s; its cycles said 2.80 s), so one that fast is
    not taken."""
    optimal = report.get("optimal_seconds")
    fastest = (report.get("flops") or 0.0) / generation.peak_bf16_flops if generation is not None else 0.0
    if optimal is not None and optimal >= 0 and optimal >= fastest:
        return float(optimal), "xla"
    if generation is not None and report.get("estimated_cycles"):
        return report["estimated_cycles"] / generation.clock_hz, "cycles"
    roofline = _roofline_seconds(report, generation)
    return (roofline, "roofline") if roofline is not None else (None, "none")


def _roofline_seconds(report: dict[str, Any], generation: Any) -> float | None:
    """The roofline time of a program: its flops at the chip's peak or XLA's bytes accessed at the chip's HBM
    bandwidth, whichever is longer. Not a strict lower bound: XLA's bytes accessed adds up every instruction's
    operands and results, including what stays on chip. None for a program with a loop (rolled layers): XLA's
    bytes count its body once."""
    if generation is None or report.get("flops") is None or report.get("bytes_accessed") is None:
        return None
    if report.get("loop_flops_added"):
        return None
    return max(report["flops"] / generation.peak_bf16_flops, report["bytes_accessed"] / generation.hbm_bytes_per_second)


def format_step_report(report: dict[str, Any]) -> str:
    """The report as text: bytes per chip by use, the fit, the time and MFU estimates and what they leave out."""
    used = report["bytes_per_chip"]
    lines = [f"{report['target']}: one step per chip"]
    for label, key in (("parameters", PARAMETERS), ("gradients", GRADIENTS), ("optimiser state", OPTIMIZER_STATE),
                       ("activations saved for backward", ACTIVATIONS), ("other inputs (batch, buffers)", INPUTS),
                       ("temporaries (largest program)", "temporaries")):
        lines.append(f"  {label:<32} {_gib(used[key])}")
    hbm = report["hbm_per_chip"]
    if report["failed"]:
        fit = ("DOES NOT FIT: a program needs more than the chip's HBM (below)" if report["fits"] is False else
               "unknown: a program did not compile (below)")
    elif hbm is None:
        fit = "unknown (no HBM figure for this chip)"
    else:
        fit = (f"{'fits' if report['fits'] else 'DOES NOT FIT'}: {_gib(report['peak_per_chip'])} of {_gib(hbm)} "
               f"HBM, margin {_gib(report['margin_bytes'])}")
    lines.append(f"  peak (estimated)                 {fit}")
    if report["suggestion"]:
        lines.append(f"  {report['suggestion']}")
    seconds = report["estimated_step_seconds"]
    how = {"xla": "XLA's cost model", "cycles": "the compiler's cycles per instruction, no overlap",
           "roofline": "the roofline"}
    basis = " and ".join(how.get(b, b) for b in report["estimated_by"])
    if seconds is None:
        lines.append("  step time                        no estimate (a program did not compile or gave no figures)")
    elif report["estimated_mfu"] is None:
        lines.append(f"  step time (estimated)            {seconds * 1e3:.1f} ms by {basis}")
    else:
        lines.append(f"  step time (estimated)            {seconds * 1e3:.1f} ms by {basis}; MFU "
                     f"{report['estimated_mfu']:.0%}")
    if report["roofline_step_seconds"] is not None and report["roofline_mfu"] is not None:
        seconds = report["roofline_step_seconds"]
        lines.append(f"  step time (roofline)             {seconds * 1e3:.1f} ms (per program the larger of"
                     f" its flops at the peak bf16 rate and XLA's bytes accessed at HBM bandwidth; those "
                     f"bytes count every instruction's operands, more than reach HBM); MFU "
                     f"{report['roofline_mfu']:.0%}")
    lines.append("  (MFU: the programs' own flops per chip over the step time at the chip's peak; neither estimate "
                 "counts time on the chip interconnect)")
    if report.get("rolled_loops"):
        lines.append("  (rolled layers: a loop's body counted once per iteration in flops and cycles; no roofline, "
                     "as XLA's bytes count the body once)")
    lines += [f"  {_budget_line(name, choice)}" for name, choice in report.get("activation_budgets", {}).items()]
    for name, error in report["failed"].items():
        lines.append(f"  {name}: {error}")
    return "\n".join(lines)


def _budget_line(graph: str, choice: dict[str, Any]) -> str:
    """How the activation budget of one training graph's partition was chosen (``BudgetChoice``)."""
    budget, estimate, hbm = choice["budget"], choice["estimated_peak"], choice["hbm"]
    head = f"activation budget of {graph}: {budget:.3g}"
    if not choice["chosen"]:
        where = " inside the rolled layers' loop bodies" if choice.get("in_loop_bodies") else ""
        return f"{head}, set by the activation_memory_budget option{where} (estimated peak {_gib(estimate)})"
    if hbm is None:
        return f"{head} (no target HBM to fit)"
    if choice["peak_at_full_budget"] is None:
        return f"{head}, chosen: the step's estimated peak {_gib(estimate)} fits {_gib(hbm)} as it is"
    over = f"at 1 the step's estimated peak is {_gib(choice['peak_at_full_budget'])}, over the chip's {_gib(hbm)}"
    if not choice["fits"]:
        return (f"{head}, chosen: {over}, and no budget fits: {_gib(estimate)} at best; lower the batch per chip, "
                "or spread the model over more chips")
    kept = (f"; the {choice['saved_boundaries']} values passed between repeated blocks are saved, so it recomputes "
            "within one block at a time" if choice.get("saved_boundaries") else "")
    if choice.get("in_loop_bodies"):
        kept = "; the budget of the rolled layers' loop bodies, so each layer recomputes its own values in the backward"
    return (f"{head}, chosen: {over}; at {budget:.3g} it is {_gib(estimate)} (the backward recomputes the rest"
            f"{kept})")


def _gib(count: float | None) -> str:
    if count is None:
        return "-"
    return f"{count / 2**30:.2f} GiB" if abs(count) >= 2**30 else f"{count / 2**20:.1f} MiB"
