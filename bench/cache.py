"""Cold and warm starts with the persistent compile cache, against Inductor's caches, in one run.

    python bench/cache.py [--layers 4] [--width 256]

Every number is measured in a fresh Python process, so nothing is reused in memory. The model is the GPT of
``examples/mingpt.py`` with 4 blocks, width 256, batch 4 x 32. For the first inference call and the first
training step (forward, backward, AdamW step) it reports:

* time to first result: process start → first result (imports, model build, Dynamo, compile or cache load);
* first call: the first compiled call alone;
* compile work (tpucompile only): time inside the backend (AOTAutograd's trace, lowering or program load,
  XLA compile or executable load) plus the backward graph's compile at the first backward; Dynamo's own
  trace, which every backend pays, is not in it.

Scenarios: tpucompile cold (empty cache dir), warm from the local directory, warm from the remote tier only
(an fsspec ``file://`` directory holding the same entries, empty local directory); Inductor cold and warm
(``TORCHINDUCTOR_CACHE_DIR`` in a temp dir, fresh each cold run).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

_START = time.perf_counter()
HERE = pathlib.Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> None:
    """Run one measurement in this (fresh) process and print it as JSON."""
    import torch

    sys.path.insert(0, str(HERE.parent / "examples"))
    from mingpt import GPT, GPTConfig

    imported = time.perf_counter() - _START
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=8, block_size=32)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (4, config.block_size))
    targets = torch.randint(0, config.vocab_size, (4, config.block_size))
    events = []
    backend = args.backend
    work = {"backend_s": 0.0, "graphs_s": 0.0}
    if args.backend == "tpucompile":
        from tpucompile import backend as ours
        from tpucompile import driver

        driver.add_observer(events.append)
        backend = _timed(ours.tpucompile_backend, work, "backend_s")  # AOTAutograd + forward/inference compile
        ours.compile_graph = _timed(ours.compile_graph, work, "graphs_s")  # every ATen graph, backward too
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    if args.phase == "inference":
        with torch.no_grad():
            result = compiled(idx)
            value = float(result.float().abs().sum())
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = compiled(idx, targets)
        loss.backward()
        optimizer.step()
        value = float(loss)
    first = time.perf_counter() - start
    total = time.perf_counter() - _START
    remotes = []
    if args.backend == "tpucompile":
        from tpucompile import artifacts

        remotes = [c.remote.describe() for c in artifacts.stores._caches.values() if c and c.remote]
    # Compile work: time inside the backend (AOTAutograd's trace and the forward compile) plus the backward
    # graph's compile, which AOTAutograd runs lazily at the first backward. Dynamo's own trace is not in it.
    graphs_outside_backend = work["graphs_s"] - work.get("graphs_in_backend_s", 0.0)
    print(json.dumps({"import_s": imported, "first_s": first, "total_s": total, "value": value,
                      "work_s": work["backend_s"] + graphs_outside_backend,
                      "tiers": [e.tier or "compiled" for e in events], "remotes": remotes}))


def _timed(fn, totals: dict, name: str):
    """``fn`` adding its wall time to ``totals[name]``; graph compiles nested in the backend are noted apart."""

    def timed(*args, **kwargs):
        inside_backend = totals.get("_in_backend", False)
        if name == "backend_s":
            totals["_in_backend"] = True
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            totals[name] += elapsed
            if name == "backend_s":
                totals["_in_backend"] = inside_backend
            elif inside_backend:
                totals["graphs_in_backend_s"] = totals.get("graphs_in_backend_s", 0.0) + elapsed

    return timed


def measure(backend: str, phase: str, env: dict[str, str], args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "--backend", backend, "--phase", phase,
               "--layers", str(args.layers), "--width", str(args.width)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{backend} {phase} failed:\n{done.stderr[-4000:]}")
    for line in done.stderr.splitlines():
        if "tpucompile:" in line:
            print(f"  [{backend} {phase}] {line}", file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def best(backend: str, phase: str, envs: list[dict[str, str]], args: argparse.Namespace) -> dict:
    """The fastest of one run per environment (each a fresh process)."""
    return min((measure(backend, phase, env, args) for env in envs), key=lambda r: r["total_s"])


def run_phase(phase: str, folder: pathlib.Path, base: dict[str, str], args: argparse.Namespace) -> dict:
    """The five scenarios of one phase; cold cells get a fresh cache directory per repeat."""
    repeat = range(max(1, args.repeat))
    local = folder / "local"
    ours = {**base, "TPUCOMPILE_CACHE_DIR": str(local)}
    cold_dirs = [*(folder / f"cold-{i}" for i in repeat[:-1]), local]  # the last cold run fills `local`
    results = {
        "tpucompile cold": best("tpucompile", phase, [{**ours, "TPUCOMPILE_CACHE_DIR": str(d)} for d in cold_dirs],
                                args),
        "tpucompile warm (local)": best("tpucompile", phase, [ours for _ in repeat], args),
    }
    # The remote tier holds exactly the entries the cold run wrote locally (same layout under v1/).
    remote = folder / "remote"
    shutil.copytree(local / "v1" / "entries", remote / "v1")
    remote_envs = [{**base, "TPUCOMPILE_CACHE_DIR": str(folder / f"fresh-local-{i}"),
                    "TPUCOMPILE_CACHE_REMOTE": f"file://{remote}"} for i in repeat]
    results["tpucompile warm (remote only)"] = best("tpucompile", phase, remote_envs, args)
    inductor = folder / "inductor"
    theirs = {**base, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    inductor_cold = [*(folder / f"inductor-cold-{i}" for i in repeat[:-1]), inductor]
    results["inductor cold"] = best("inductor", phase,
                                    [{**theirs, "TORCHINDUCTOR_CACHE_DIR": str(d)} for d in inductor_cold], args)
    results["inductor warm"] = best("inductor", phase, [theirs for _ in repeat], args)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="tpucompile", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="inference", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--phases", default="inference,train", help="comma-separated: inference, train")
    parser.add_argument("--repeat", type=int, default=1, help="runs per cell (fresh cache dirs for cold cells); "
                        "the fastest is reported, which damps noise from other work on the machine")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    base = {k: v for k, v in os.environ.items() if not k.startswith(("TPUCOMPILE_", "TORCHINDUCTOR_"))}
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpucompile-bench-") as tmp:
        root = pathlib.Path(tmp)
        for phase in args.phases.split(","):
            results = run_phase(phase, root / phase, base, args)
            rows.append((phase, results))
            for name, result in results.items():
                print(f"{phase} {name}: {result['total_s']:.2f}s {result.get('tiers', '')} "
                      f"{result.get('remotes') or ''}", file=sys.stderr)

    print(f"\nGPT: {args.layers} blocks, width {args.width}, batch 4 x 32, CPU; each cell a fresh process.\n")
    print("| phase | scenario | executables | time to first result (s) | first call (s) | compile work (s) "
          "| work vs cold | vs tpucompile cold | vs inductor warm |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")  # the last two: ratios of time to first result
    for phase, results in rows:
        cold = results["tpucompile cold"]
        inductor_warm = results["inductor warm"]["total_s"]
        for name, result in results.items():
            tiers = result.get("tiers") or []
            where = ", ".join(f"{tiers.count(t)} {t}" for t in dict.fromkeys(tiers)) or "-"
            work = result.get("work_s") if name.startswith("tpucompile") else None
            work_cells = f"{work:.2f} | {work / cold['work_s']:.1%}" if work is not None else "- | -"
            print(f"| {phase} | {name} | {where} | {result['total_s']:.2f} | {result['first_s']:.2f} | "
                  f"{work_cells} | {result['total_s'] / cold['total_s']:.2f}x | "
                  f"{result['total_s'] / inductor_warm:.2f}x |")


if __name__ == "__main__":
    main()
