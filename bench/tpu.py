"""What XLA's TPU compiler makes of tpucompile's programs, against the same models written by hand in JAX.

    python bench/tpu.py [--target tpu:v5e:1x1] [--workloads gpt,llama] [--modes training] [--dtypes bfloat16]
                        [--json out.json] [--breakdown gpt:training:bfloat16] [--top 25]

No TPU is needed: libtpu compiles for a chip described by topology, and the figures are the compiler's own
(``cost_analysis()``: flops, HBM bytes accessed, its time estimate ``optimal_seconds``;
``get_compiled_memory_stats()``: peak memory and what is aliased). Every example model (``tpu_workloads.py``),
inference and training, float32 and bfloat16, goes through ``torch.compile(backend="tpucompile",
options={"targets": [target], "compile_only": True})``: its graphs are lowered and compiled for the target and
nothing runs here. The reference is ``bench/jax_reference/<model>.py``, jitted for the same device: its
forward for inference, one ``jax.jit(jax.value_and_grad(loss))`` program for training; its attention is
jax's splash kernel, as tpucompile's is on a TPU (``--reference-attention math`` for the math form).

Per row: flops, bytes and estimated time summed over tpucompile's programs (forward + backward in training),
peak memory as the largest program's, the bytes the forward saves for the backward (activations; weights it
passes on are counted apart), and the ratios to the reference. MFU is the reference's flops over the estimated
time at the chip's peak bf16 rate (the compiler's ``optimal_seconds`` where both sides have one, else, as for
most of these programs, where one is negative, both sides' summed per-instruction cycle estimates at the chip's
clock: an estimate without overlap, comparable between the two sides). Pallas kernel calls get no estimate from
XLA (neither cycles nor flops): the last column counts them per side, their time is in neither side's estimate,
and where the counts differ the cycle ratio is not given. ``--breakdown`` lists, for one row, each program's
top-level instructions by the bytes they move, with the op and source line that made them (``hlo_bytes.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import torch
from jaxlib import _hlo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hlo_bytes
import tpu_workloads
from jax_reference import attention as reference_attention

from tpucompile import driver
from tpucompile.contracts.target_names import generation_of
from tpucompile.runtime.targets.compile_only import compile_only_target
from tpucompile.runtime.targets.cross_compile import TargetExecutable

_PRINT = _hlo.HloPrintOptions()
_PRINT.print_operand_shape = True  # what the breakdown reads operand sizes from

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class Program:
    role: str
    flops: float
    bytes_accessed: float
    optimal_seconds: float | None
    memory: dict[str, int]
    cycles: int = 0
    """The sum of the TPU compiler's per-instruction cycle estimates (``hlo_bytes``): a time estimate that
    ignores overlap, for programs whose ``optimal_seconds`` is negative (the cost model has no estimate)."""
    hlo: str = dataclasses.field(repr=False, default="")
    kernels: int = 0
    """Pallas kernel calls (``tpu_custom_call``) at the program's top level: XLA estimates neither their
    cycles nor their flops, so they are in neither side's estimate, and the estimates compare like with like
    only where both sides make the same calls (the table says so where they do not)."""


@dataclasses.dataclass
class Row:
    workload: str
    mode: str
    dtype: str
    ours: list[Program]
    reference: Program
    saved_activation_bytes: int = 0
    saved_weight_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None

    def totals(self) -> dict[str, Any]:
        times = [p.optimal_seconds for p in self.ours]
        return {
            "flops": sum(p.flops for p in self.ours),
            "bytes": sum(p.bytes_accessed for p in self.ours),
            "peak": max(p.memory["peak"] for p in self.ours),
            "alias": sum(p.memory["alias"] for p in self.ours),
            "seconds": sum(times) if all(t is not None and t > 0 for t in times) else None,
            "cycles": sum(p.cycles for p in self.ours),
            "kernels": sum(p.kernels for p in self.ours),
        }


def _program(role: str, executable: Any) -> Program:
    report = TargetExecutable(executable, 0.0).report()
    seconds = report.get("optimal_seconds")
    hlo = "\n".join(m.to_string(_PRINT) for m in executable.hlo_modules())
    rows = hlo_bytes.entry_traffic(hlo)
    cycles = sum(row.cycles for row in rows)
    kernels = sum(row.opcode == "custom-call:tpu_custom_call" for row in rows)
    return Program(role, report.get("flops") or 0.0, report.get("bytes_accessed") or 0.0, seconds,
                   report["memory"], cycles, hlo, kernels)


def ours(workload: tpu_workloads.TpuWorkload, mode: str, target: str, extra: dict[str, Any] | None = None
         ) -> tuple[list[Program], int, int]:
    """tpucompile's programs for the workload's step, compiled for ``target`` only (with the ``extra``
    options), and the bytes its backward receives from its forward (activations, weights)."""
    events: list[driver.CompileEvent] = []
    remove = driver.add_observer(events.append)
    torch._dynamo.reset()
    options = {"targets": [target], "compile_only": True, "cache_mode": "off", **(extra or {})}
    compiled = torch.compile(workload.model, backend="tpucompile", options=options)
    try:
        if mode == "inference":
            workload.model.eval()
            with torch.no_grad():
                compiled(*workload.inference_inputs)
        elif mode == "training":
            workload.model.train()
            workload.loss(compiled, *workload.training_inputs).backward()
        else:  # "step": forward, backward and update as one program, as JAX compiles a training step
            workload.model.train()
            torch.compile(_whole_step(workload), backend="tpucompile", options=options)(
                {k: v.detach().clone() for k, v in workload.model.named_parameters()},
                {k: v.clone() for k, v in workload.model.named_buffers()})
    finally:
        remove()
    programs, activations, weights = [], 0, 0
    for event in events:
        if event.target != target:
            continue
        if event.error is not None or event.executable is None:
            raise RuntimeError(f"{event.name} did not compile for {target}: {event.error}")
        role = event.name.rsplit("(", 1)[-1].rstrip(")") if "(" in event.name else event.name
        program = _program(role, event.executable)
        program.flops += event.program.repeated_flops  # XLA counts a loop's body once (rolled layers)
        programs.append(program)
        saved = event.saved_for_backward()
        if saved is not None:
            activations += saved["activations"]
            weights += saved["arguments"]
    return programs, activations, weights


def _whole_step(workload: tpu_workloads.TpuWorkload):
    """The training step as one function of the parameters: ``torch.func.grad_and_value`` over
    ``torch.func.functional_call``, which Dynamo captures as one graph (forward and backward together), then an
    SGD update of the parameters in place (the step's program updates them in their own memory: donated)."""
    model = workload.model

    def step(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        def loss(values: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> torch.Tensor:
            return workload.loss(
                lambda *args, **kwargs: torch.func.functional_call(model, (values, state), args, kwargs),
                *workload.training_inputs)

        grads, value = torch.func.grad_and_value(loss)(params, buffers)  # buffers an argument: BatchNorm
        with torch.no_grad():  # updates them
            for name, param in params.items():
                param.sub_(grads[name], alpha=LEARNING_RATE)
        return value

    return step


LEARNING_RATE = 1e-3
"""The step mode's SGD learning rate (on both sides; its value changes nothing measured)."""


def reference(workload: tpu_workloads.TpuWorkload, mode: str, device: Any) -> Program:
    """The hand-written JAX program for the workload's step, compiled for ``device``: the forward for
    inference, ``jax.value_and_grad`` for training, and for the whole step that plus an SGD update with the
    parameters (and BatchNorm's statistics) donated, as a JAX training loop jits it."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    params = {name: _struct(p, sharding) for name, p in workload.model.named_parameters()}
    buffers = {name: _struct(b, sharding) for name, b in workload.model.named_buffers()}
    module, config = workload.reference, workload.config
    donated: tuple[int, ...] = ()
    if mode == "inference":
        def step(params, buffers, inputs):
            return module.forward({**params, **buffers}, inputs, config)

        inputs = _struct(workload.inference_inputs, sharding)
    else:
        def gradients(params, buffers, inputs):
            def loss(params):
                return module.loss({**params, **buffers}, inputs, config)

            return jax.value_and_grad(loss, has_aux=workload.reference_loss_has_buffers)(params)

        if mode == "training":
            step = gradients
        else:
            def step(params, buffers, inputs):
                value, grads = gradients(params, buffers, inputs)
                updated = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
                if workload.reference_loss_has_buffers:
                    value, buffers = value
                    return updated, buffers, value
                return updated, value

            donated = (0, 1) if workload.reference_loss_has_buffers else (0,)
        inputs = _struct(workload.training_inputs, sharding)
    compiled = jax.jit(step, donate_argnums=donated).lower(params, buffers, inputs).compile()
    return _program("jax", compiled.runtime_executable())


def _struct(value: Any, sharding: Any) -> Any:
    """``jax.ShapeDtypeStruct``s for torch tensors (nested in lists and tuples); integer tensors become int32,
    as a JAX program holds token ids and indices."""
    if isinstance(value, torch.Tensor):
        dtype = {torch.bfloat16: jax.numpy.bfloat16}.get(value.dtype) or (
            np.int32 if not value.is_floating_point() and value.dtype != torch.bool else
            torch.empty(0, dtype=value.dtype).numpy().dtype)
        return jax.ShapeDtypeStruct(tuple(value.shape), dtype, sharding=sharding)
    if isinstance(value, (list, tuple)):
        return type(value)(_struct(v, sharding) for v in value)
    return value


def measure(name: str, mode: str, dtype: str, target: str, device: Any, extra: dict[str, Any] | None = None) -> Row:
    start = time.perf_counter()
    workload = tpu_workloads.build(name, _DTYPES[dtype])
    ref = reference(workload, mode, device)
    try:
        programs, activations, weights = ours(workload, mode, target, extra)
    except Exception as error:  # a row that cannot be measured says why; the others still are
        return Row(name, mode, dtype, [], ref, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    return Row(name, mode, dtype, programs, ref, activations, weights, time.perf_counter() - start)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b:
        return "n/a"
    return f"{a / b:.2f}x"


def _mfu(model_flops: float, seconds: float | None, peak_flops: float | None) -> str:
    return f"{model_flops / (seconds * peak_flops):.0%}" if seconds and peak_flops else "n/a"


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f}"


def report(rows: list[Row], peak_flops: float | None, clock: float | None) -> str:
    header = ("| workload | mode | dtype | programs | flops G (ratio) | HBM GB ours / JAX (ratio) | "
              "peak MiB ours / JAX (ratio) | aliased MiB | saved for bw MiB (act + weights) | "
              "est. ms ours / JAX (ratio) | est. Mcycles ours / JAX (ratio) | est. MFU ours / JAX | "
              "kernel calls ours / JAX |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        if row.error is not None:
            lines.append(f"| {row.workload} | {row.mode} | {row.dtype} | failed: {row.error} |")
            continue
        t, r = row.totals(), row.reference
        ref_seconds = r.optimal_seconds if r.optimal_seconds and r.optimal_seconds > 0 else None
        # one source of time for both sides: XLA's estimate where both have one, else the cycles at the clock
        if t["seconds"] and ref_seconds:
            ours_time, ref_time = t["seconds"], ref_seconds
        else:
            ours_time, ref_time = (t["cycles"] / clock, r.cycles / clock) if clock else (None, None)
        saved = (f"{_mib(row.saved_activation_bytes)} + {_mib(row.saved_weight_bytes)}"
                 if row.mode == "training" else "")
        seconds = "n/a" if t["seconds"] is None else f"{t['seconds'] * 1e3:.2f}"
        unlike = t["kernels"] != r.kernels  # one side's kernels are outside its estimate, the other's inside
        cycle_ratio = "n/a: kernel calls differ" if unlike else _ratio(t["cycles"], r.cycles)
        ref_ms = "n/a" if ref_seconds is None else f"{ref_seconds * 1e3:.2f}"
        lines.append(
            f"| {row.workload} | {row.mode} | {row.dtype} | {'+'.join(p.role[:3] for p in row.ours)} | "
            f"{t['flops'] / 1e9:.1f} ({_ratio(t['flops'], r.flops)}) | "
            f"{_gb(t['bytes'])} / {_gb(r.bytes_accessed)} ({_ratio(t['bytes'], r.bytes_accessed)}) | "
            f"{_mib(t['peak'])} / {_mib(r.memory['peak'])} ({_ratio(t['peak'], r.memory['peak'])}) | "
            f"{_mib(t['alias'])} | {saved} | {seconds} / {ref_ms} ({_ratio(t['seconds'], ref_seconds)}) | "
            f"{t['cycles'] / 1e6:.1f} / {r.cycles / 1e6:.1f} ({cycle_ratio}) | "
            f"{_mfu(r.flops, ours_time, peak_flops)} / {_mfu(r.flops, ref_time, peak_flops)} | "
            f"{t['kernels']} / {r.kernels} |")
    return "\n".join(lines)


def breakdown(row: Row, top: int) -> str:
    parts = []
    for program in [*row.ours, row.reference]:
        rows = hlo_bytes.entry_traffic(program.hlo)
        parts.append(f"### {row.workload} {row.mode} {row.dtype}: {program.role} "
                     f"(XLA: {program.bytes_accessed / 1e9:.2f} GB accessed)\n\n{hlo_bytes.table(rows, top)}\n")
    return "\n".join(parts)


def _option(text: str) -> tuple[str, Any]:
    name, _, value = text.partition("=")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tpu:v5e:1x1")
    parser.add_argument("--workloads", default=",".join(tpu_workloads.NAMES))
    parser.add_argument("--modes", default="inference,training,step",
                        help="inference; training (forward and backward programs, as torch.compile of a module "
                             "gives them); step (one program: torch.func.grad_and_value of the loss)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--breakdown", action="append", default=[],
                        help="workload:mode:dtype whose programs to break down by bytes (repeatable)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--reference-attention", choices=("kernel", "math"), default="kernel",
                        help="the example models' references (GPT, Llama, Qwen): attention by the splash kernel, "
                             "as a JAX user writes it for a TPU, or in its math form (the HF references always "
                             "take the kernel)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a tpucompile option for our side, e.g. activation_memory_budget=0.5 (repeatable; "
                             "the value is read as JSON, else as a string)")
    args = parser.parse_args()
    extra = dict(_option(text) for text in args.option)
    reference_attention.KERNEL = args.reference_attention == "kernel"

    device = compile_only_target(args.target).devices[0]
    generation = generation_of(device.device_kind)
    # peak rate and clock of the chip (tpucompile's own table): MFU, and cycles as seconds where XLA gives none
    peak_flops, clock = (generation.peak_bf16_flops, generation.clock_hz) if generation else (None, None)
    wanted = [(w, m, d) for w in args.workloads.split(",") for m in args.modes.split(",")
              for d in args.dtypes.split(",")]
    wanted += [tuple(b.split(":")) for b in args.breakdown if tuple(b.split(":")) not in wanted]
    rows = []
    for name, mode, dtype in wanted:
        print(f"{name} {mode} {dtype} ...", file=sys.stderr, flush=True)
        rows.append(measure(name, mode, dtype, args.target, device, extra))
        # each row as it is measured: a long run cut short still leaves what it measured
        print(report(rows[-1:], peak_flops, clock).splitlines()[-1], file=sys.stderr, flush=True)
        if args.json:
            _write_json(args.json, args.target, rows)
    print(f"## {args.target} ({device.device_kind}), jax {jax.__version__}, torch {torch.__version__}"
          + (f", options {extra}" if extra else "") + "\n")
    print(report(rows, peak_flops, clock))
    for spec in args.breakdown:
        row = next(r for r in rows if (r.workload, r.mode, r.dtype) == tuple(spec.split(":")))
        print()
        print(breakdown(row, args.top))


def _write_json(path: str, target: str, rows: list[Row]) -> None:
    """The rows measured so far, rewritten whole after each row."""
    with open(path, "w") as stream:
        json.dump({"target": target, "rows": [
            {"workload": r.workload, "mode": r.mode, "dtype": r.dtype, "seconds": round(r.seconds, 1),
             "error": r.error,
             "ours": [{k: v for k, v in dataclasses.asdict(p).items() if k != "hlo"} for p in r.ours],
             "reference": {k: v for k, v in dataclasses.asdict(r.reference).items() if k != "hlo"},
             "saved_activation_bytes": r.saved_activation_bytes, "saved_weight_bytes": r.saved_weight_bytes}
            for r in rows]}, stream, indent=1, default=lambda v: None if isinstance(v, float) and math.isnan(v)
            else v)


if __name__ == "__main__":
    main()
