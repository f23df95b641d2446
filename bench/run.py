"""Step time, compile time, warm start and memory of every example model: eager vs Inductor vs tpucompile.

    python bench/run.py [--quick] [--models gpt,llama] [--backends eager,inductor,tpucompile]
                        [--modes inference,train] [--out docs/benchmarks] [--repeat N]

Every cell runs in fresh Python processes, one per measurement, with its own empty cache directories:

* cold: the first process compiles with empty caches (``TPUCOMPILE_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``);
  *compile* is its first call minus one steady-state step;
* warm: a second process with the caches the first one filled; *warm start* is its time from process start
  to the first result (imports, model build, Dynamo, cache loads, one step);
* steady state: in the warm process, after warm-up calls, the median (and min-max) of timed steps;
* memory: the process's peak resident set size.

A training step is forward, backward and an SGD step. Backends run in turn for each cell (and in rotated
order from cell to cell), so that drift in the machine's load hits all of them alike. The results are printed
as a markdown table and written as JSON, markdown and a PNG chart of the speedup over eager.
"""

from __future__ import annotations

import argparse
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
BACKENDS = ("eager", "inductor", "tpucompile")
MODES = ("inference", "train")


def child(args: argparse.Namespace) -> None:
    """One measurement in this fresh process, printed as one JSON line."""
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
    if backend == "tpucompile":  # by object, so that a checkout run without `pip install` works too
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

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    to_first_result = time.perf_counter() - _START
    for _ in range(args.warmup):
        step()
    times = []
    deadline = time.perf_counter() + args.budget
    while len(times) < args.iters and (len(times) < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"first_s": first, "to_first_result_s": to_first_result, "step_ms": [t * 1e3 for t in times],
                      "peak_bytes": peak}))


def measure(model: str, mode: str, backend: str, env: dict[str, str], args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "--model", model, "--mode", mode, "--backend", backend,
               "--iters", str(args.iters), "--warmup", str(args.warmup), "--budget", str(args.budget),
               "--threads", str(args.threads), "--device", args.device]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_cell(model: str, mode: str, backend: str, folder: pathlib.Path, args: argparse.Namespace) -> dict:
    """Cold then warm process for one backend (eager: one process, it has nothing to compile or cache)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TPUCOMPILE_", "TORCHINDUCTOR_"))}
    caches = folder / f"{model}-{mode}-{backend}"
    env = {**base, "TPUCOMPILE_CACHE_DIR": str(caches / "tpucompile"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    cold = measure(model, mode, backend, env, args)
    if "error" in cold or backend == "eager":
        return {"cold": cold, "warm": cold}
    return {"cold": cold, "warm": measure(model, mode, backend, env, args)}


def summarize(cell: dict) -> dict:
    cold, warm = cell["cold"], cell["warm"]
    if "error" in cold or "error" in warm:
        return {"error": cold.get("error") or warm.get("error")}
    steps = warm["step_ms"]
    median = statistics.median(steps)
    return {
        "step_ms": median, "step_min_ms": min(steps), "step_max_ms": max(steps), "steps": len(steps),
        "compile_s": max(0.0, cold["first_s"] - median / 1e3),
        "warm_start_s": warm["to_first_result_s"],
        "peak_mb": max(cold["peak_bytes"], warm["peak_bytes"]) / 2**20,
    }


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="MLP and GPT only, fewer timed steps")
    parser.add_argument("--models", help="comma-separated subset of mlp,gpt,llama,qwen,resnet,unet,dlrm")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--iters", type=int, default=30, help="timed steps per cell (at most)")
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
    sys.path.insert(0, str(HERE))
    from models import WORKLOADS

    models = args.models.split(",") if args.models else (["mlp", "gpt"] if args.quick else list(WORKLOADS))
    if args.quick:
        args.iters, args.warmup, args.budget = min(args.iters, 10), min(args.warmup, 2), min(args.budget, 3.0)
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
                for backend in order:
                    cell = run_cell(model, mode, backend, pathlib.Path(tmp), args)
                    results[f"{model}/{mode}/{backend}"] = summarize(cell)
                    r = results[f"{model}/{mode}/{backend}"]
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
