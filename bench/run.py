"""Step time, compile time, warm start and memory of every example model: eager vs Inductor vs tpucompile.

    python bench/run.py [--quick] [--models gpt,llama] [--backends eager,inductor,tpucompile,tpucompile-xla]
                        [--modes inference,train] [--rounds N] [--out docs/benchmarks]

Every cell runs in fresh Python processes with its own empty cache directories:

* cold: the first process compiles with empty caches (``TPUCOMPILE_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``);
  *compile* is its first call minus one steady-state step;
* warm: a second process with the caches the first one filled; *warm start* is its time from process start
  to the first result (imports, model build, Dynamo, cache loads, one step);
* steady state: the warm processes of a model and mode's backends stay alive together (one at a time busy)
  and take turns, ``--rounds`` rounds of an equal share of the timed steps each, every turn after two untimed
  steps; the median (and min-max) of a backend's timed steps over all its turns. Taking turns within a cell,
  rather than one backend after the other, is what keeps the ratios between backends steady on a machine
  whose speed drifts from minute to minute;
* memory: the peak resident set size of the backend's processes.

With tpucompile and tpucompile-xla both run, a last table gives the host kernels' effect: the ratio of their
median steps, and the median (and range) of the per-turn ratios of the two, whose turns of a round run back to
back, so the drift between rounds cancels.

A training step is forward, backward and an SGD step. The order of the backends rotates from turn to turn and
from cell to cell. The results are printed as a markdown table and written as JSON, markdown and a PNG chart
of the speedup over eager.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

_START = time.perf_counter()
HERE = pathlib.Path(__file__).resolve().parent
BACKENDS = ("eager", "inductor", "tpucompile", "tpucompile-xla")
BACKEND_ENV = {"tpucompile-xla": {"TPUCOMPILE_HOST_KERNELS": "off"}}
"""tpucompile-xla is tpucompile with XLA's own dots and convolutions only (no host kernels): beside tpucompile
in the same run, it shows what the host kernels' per-op choice gains or loses on each workload."""
MODES = ("inference", "train")


def child(args: argparse.Namespace) -> None:
    """One process of a cell: the first call, warm-up, then (``--serve``) timed steps on request.

    Prints one JSON line after warm-up; when serving, reads one JSON request per line from stdin (``steps``:
    run ``warmup`` untimed and up to ``iters`` timed steps, at least 3 and within ``budget`` seconds; ``stop``)
    and answers each with one JSON line. The last line carries the process's peak resident set size.
    """
    import resource

    import torch

    sys.path.insert(0, str(HERE))
    from models import build

    torch.set_num_threads(args.threads)
    workload = build(args.model, args.device)
    model = workload.model
    if args.mode == "inference" and workload.eval_for_inference:
        model.eval()
    backend: object = args.backend
    if args.backend.startswith("tpucompile"):  # by object, so that a checkout without `pip install` works too
        from tpucompile.backend import tpucompile_backend as backend
    run = model if args.backend == "eager" else torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        if args.mode == "inference":
            with torch.no_grad():
                run(*workload.inputs)
        else:
            optimizer.zero_grad(set_to_none=True)
            workload.loss(run).backward()
            optimizer.step()
        if args.device == "cuda":
            torch.cuda.synchronize()

    def answer(message: dict) -> None:
        print(json.dumps(message), flush=True)

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    to_first_result = time.perf_counter() - _START
    for _ in range(args.warmup):
        step()
    answer({"first_s": first, "to_first_result_s": to_first_result})
    for line in sys.stdin if args.serve else ():
        request = json.loads(line)
        if request["op"] != "steps":
            break
        for _ in range(request["warmup"]):
            step()
        times = []
        deadline = time.perf_counter() + request["budget"]
        while len(times) < request["iters"] and (len(times) < 3 or time.perf_counter() < deadline):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        answer({"step_ms": times})
    answer({"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})


class Process:
    """A child process of one cell, spoken to one JSON line at a time; its error, if it failed."""

    def __init__(self, model: str, mode: str, backend: str, env: dict[str, str], args: argparse.Namespace,
                 serve: bool) -> None:
        command = [sys.executable, __file__, "--child", "--model", model, "--mode", mode, "--backend", backend,
                   "--warmup", str(args.warmup), "--threads", str(args.threads), "--device", args.device]
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the child; closed by finish)
        self.process = subprocess.Popen(command + (["--serve"] if serve else []), env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.error: str | None = None

    def read(self) -> dict:
        """The child's next answer; ``{"error": ...}`` (and the error kept) when it died instead."""
        if self.error is None:
            line = self.process.stdout.readline()
            if line.strip():
                return json.loads(line)
            self.process.wait()
            self.log.seek(0)
            lines = self.log.read().strip().splitlines()
            self.error = lines[-1] if lines else f"exit {self.process.returncode}"
        return {"error": self.error}

    def ask(self, request: dict) -> dict:
        if self.error is None:
            try:
                self.process.stdin.write(json.dumps(request) + "\n")
                self.process.stdin.flush()
            except BrokenPipeError:
                pass  # read() reports why
        return self.read()

    def finish(self) -> dict:
        """Stop the child; its last answer (peak memory)."""
        answer = self.ask({"op": "stop"})
        with contextlib.suppress(BrokenPipeError):  # a child that died leaves the request unsent
            self.process.stdin.close()
        self.process.wait(timeout=600)
        self.log.close()
        return answer


def run_cells(model: str, mode: str, order: list[str], folder: pathlib.Path, args: argparse.Namespace) -> dict:
    """Every backend's cell of one model and mode: cold processes one by one, then the warm ones (started one
    by one, so warm starts do not overlap) taking turns at timed steps."""
    # No switch or cache setting of the caller leaks into a cell; where the host kernel library is built may.
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("TPUCOMPILE_", "TORCHINDUCTOR_")) or k == "TPUCOMPILE_BUILD_DIR"}
    envs = {backend: {**base, "TPUCOMPILE_CACHE_DIR": str(folder / f"{model}-{mode}-{backend}" / "tpucompile"),
                      "TORCHINDUCTOR_CACHE_DIR": str(folder / f"{model}-{mode}-{backend}" / "inductor"),
                      **BACKEND_ENV.get(backend, {})}
            for backend in order}
    cells: dict[str, dict] = {}
    for backend in order:
        if backend == "eager":  # nothing to compile or cache: its one process is cold and warm at once
            continue
        cold = Process(model, mode, backend, envs[backend], args, serve=False)
        first = cold.read()
        cells[backend] = {"cold": {**first, **cold.finish()}, "step_ms": [], "turn_ms": []}
    warm: dict[str, Process] = {}
    for backend in order:
        process = warm[backend] = Process(model, mode, backend, envs[backend], args, serve=True)
        cells.setdefault(backend, {"step_ms": [], "turn_ms": []})["warm"] = process.read()
    share = max(3, math.ceil(args.iters / args.rounds))
    for turn in range(args.rounds):
        shift = turn % len(order)
        for backend in order[shift:] + order[:shift]:
            answer = warm[backend].ask({"op": "steps", "iters": share, "warmup": 2,
                                        "budget": args.budget / args.rounds})
            steps = answer.get("step_ms", [])
            cells[backend]["step_ms"] += steps
            cells[backend]["turn_ms"].append(statistics.median(steps) if steps else math.nan)
    for backend, process in warm.items():
        cell = cells[backend]
        cell["warm"] = {**cell["warm"], **process.finish()}  # peak memory, or the error the child died of
        if backend == "eager":
            cell["cold"] = cell["warm"]
    return cells


def summarize(cell: dict) -> dict:
    cold, warm, steps = cell["cold"], cell["warm"], cell["step_ms"]
    if "error" in cold or "error" in warm or not steps:
        return {"error": cold.get("error") or warm.get("error") or "no timed steps"}
    median = statistics.median(steps)
    return {
        "step_ms": median, "step_min_ms": min(steps), "step_max_ms": max(steps), "steps": len(steps),
        "turn_ms": cell["turn_ms"],
        "compile_s": max(0.0, cold["first_s"] - median / 1e3),
        "warm_start_s": warm["to_first_result_s"],
        "peak_mb": max(cold["peak_bytes"], warm["peak_bytes"]) / 2**20,
    }


def paired_ratio(numerator: dict, denominator: dict) -> str:
    """The median (and range) of the ratios of two backends' median steps turn by turn: the two turns of a
    round run back to back, so drift that moves the whole machine from minute to minute cancels in each ratio,
    and the range shows how far one round can stray."""
    turns = zip(numerator.get("turn_ms", []), denominator.get("turn_ms", []), strict=True)
    ratios = [a / b for a, b in turns if not (math.isnan(a) or math.isnan(b))]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def table(results: dict, backends: list[str], modes: list[str], models: list[str]) -> str:
    lines = ["| model | mode | backend | step ms (median, min-max) | speedup vs eager | compile s | warm start s "
             "| peak MB |", "|---|---|---|---:|---:|---:|---:|---:|"]
    speedups: dict[tuple[str, str], list[float]] = {}
    for model in models:
        for mode in modes:
            eager = results.get(f"{model}/{mode}/eager", {})
            for backend in backends:
                r = results.get(f"{model}/{mode}/{backend}")
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {model} | {mode} | {backend} | failed: {r['error'][:80]} | | | | |")
                    continue
                speedup = eager["step_ms"] / r["step_ms"] if "step_ms" in eager else float("nan")
                if backend != "eager" and not math.isnan(speedup):
                    speedups.setdefault((backend, mode), []).append(speedup)
                compile_cells = ("-", "-") if backend == "eager" else (f"{r['compile_s']:.2f}",
                                                                       f"{r['warm_start_s']:.2f}")
                lines.append(
                    f"| {model} | {mode} | {backend} | {r['step_ms']:.2f} ({r['step_min_ms']:.2f}-"
                    f"{r['step_max_ms']:.2f}) | {'-' if math.isnan(speedup) else f'{speedup:.2f}x'} | "
                    f"{compile_cells[0]} | {compile_cells[1]} | "
                    f"{r['peak_mb']:.0f} |"
                )
    lines.append("")
    lines.append("| backend | mode | geometric-mean speedup over eager | models |")
    lines.append("|---|---|---:|---:|")
    for (backend, mode), values in sorted(speedups.items()):
        lines.append(f"| {backend} | {mode} | {geomean(values):.2f}x | {len(values)} |")
    if not speedups:
        lines.append("| - | - | (eager was not run: no speedups) | - |")
    if {"tpucompile", "tpucompile-xla"} <= set(backends):
        lines += ["", "| model | mode | tpucompile / tpucompile-xla step time (host kernels' effect; < 1 is a gain) "
                  "| per turn: median (min-max) |", "|---|---|---:|---:|"]
        for model in models:
            for mode in modes:
                with_kernels = results.get(f"{model}/{mode}/tpucompile", {})
                without = results.get(f"{model}/{mode}/tpucompile-xla", {})
                if "step_ms" in with_kernels and "step_ms" in without:
                    lines.append(f"| {model} | {mode} | {with_kernels['step_ms'] / without['step_ms']:.3f} | "
                                 f"{paired_ratio(with_kernels, without)} |")
    return "\n".join(lines)


def chart(results: dict, models: list[str], modes: list[str], path: pathlib.Path) -> bool:
    """A PNG of the speedup over eager per model; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for axis, mode in zip(axes[0], modes, strict=True):
        for offset, backend in enumerate(("inductor", "tpucompile")):
            values = []
            for model in models:
                eager, r = results.get(f"{model}/{mode}/eager", {}), results.get(f"{model}/{mode}/{backend}", {})
                values.append(eager["step_ms"] / r["step_ms"] if "step_ms" in eager and "step_ms" in r else 0.0)
            axis.bar([i + 0.4 * offset for i in range(len(models))], values, width=0.4, label=backend)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([i + 0.2 for i in range(len(models))], models)
        axis.set_title(f"{mode}: speedup over eager (higher is better)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True


def machine() -> str:
    import torch

    cores = os.cpu_count()
    return (f"{platform.processor() or platform.machine()}, {cores} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def main() -> None:
    sys.path.insert(0, str(HERE))
    from models import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="MLP and GPT only, fewer timed steps")
    parser.add_argument("--models", help="comma-separated subset of " + ",".join(WORKLOADS))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--iters", type=int, default=30,
                        help="timed steps per cell, shared over the rounds (each turn takes at least 3)")
    parser.add_argument("--rounds", type=int, default=3, help="turns each backend takes at its timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget", type=float, default=10.0, help="seconds of timed steps per cell (at most)")
    parser.add_argument("--device", default="cpu", help="where the model and its tensors live (cpu, cuda)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    parser.add_argument("--out", default=str(HERE.parent / "docs" / "benchmarks"),
                        help="prefix of the .json, .md and .png written")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    models = args.models.split(",") if args.models else (["mlp", "gpt"] if args.quick else list(WORKLOADS))
    if args.quick:
        args.iters, args.warmup, args.budget = min(args.iters, 10), min(args.warmup, 2), min(args.budget, 3.0)
        args.rounds = min(args.rounds, 2)
    args.rounds = max(1, args.rounds)
    backends, modes = args.backends.split(","), args.modes.split(",")
    unknown = sorted(set(models) - set(WORKLOADS)) + sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"unknown models or backends: {', '.join(unknown)}")
    results: dict[str, dict] = {}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tpucompile-bench-") as tmp:
        rotation = 0
        for model in models:
            for mode in modes:
                order = backends[rotation % len(backends):] + backends[: rotation % len(backends)]
                rotation += 1
                cells = run_cells(model, mode, order, pathlib.Path(tmp), args)
                for backend in backends:
                    r = results[f"{model}/{mode}/{backend}"] = summarize(cells[backend])
                    status = r.get("error") or f"{r['step_ms']:.2f} ms/step"
                    print(f"{model} {mode} {backend}: {status}", file=sys.stderr, flush=True)
    text = table(results, backends, modes, models)
    header = (f"Machine: {machine()}. Run of {time.strftime('%Y-%m-%d', time.gmtime(started))}, "
              f"{(time.time() - started) / 60:.1f} min{' (--quick)' if args.quick else ''}.")
    print(f"\n{header}\n\n{text}")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "results": results}, indent=1) + "\n")
    drew = chart(results, models, modes, out.with_suffix(".png"))
    out.with_suffix(".table.md").write_text(f"{header}\n\n{text}\n" + (
        f"\n![speedup over eager]({out.with_suffix('.png').name})\n" if drew else ""))


if __name__ == "__main__":
    main()
