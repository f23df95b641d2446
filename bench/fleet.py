"""A fleet starting the same job on a cold cache: compiles and wall time with the Redis remote tier vs none.

    python bench/fleet.py [--hosts 32] [--wave 8] [--layers 4] [--width 256]

Each simulated host is a fresh Python process with an empty cache directory of its own, running one
training step (forward and backward) of the GPT of ``examples/mingpt.py``. Hosts start in waves of
``--wave`` processes (all 32 at once would swamp a small machine: each process needs a core for its imports
and compiles); the processes of a wave wait for each other after their imports, so they reach the graphs
together, as a fleet's hosts do. With the remote tier (a redis-server this script starts) the first wave
races on the cold cache and the lease lets one host compile each graph while the others wait for its entry;
later waves find the entries published. Without it every host compiles every graph.

Prints, per configuration: executables compiled in total (``tpucompile.stats()`` of every host) and the
seconds they took in XLA, wall time from the first host's start to the last host's end, and the ratios. The
lease saves XLA compiles only: every host still imports, traces and lowers its graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> None:
    """One host: a training step on a cold cache; prints what it compiled and loaded as JSON."""
    start = time.perf_counter()
    import torch

    import tpucompile
    from tpucompile import artifacts
    from tpucompile.artifacts import executables

    compile_seconds = [0.0]
    compile_now = executables.compile_module

    def timed_compile(*args, **kwargs):
        began = time.perf_counter()
        try:
            return compile_now(*args, **kwargs)
        finally:
            compile_seconds[0] += time.perf_counter() - began

    executables.compile_module = timed_compile

    sys.path.insert(0, str(HERE.parent / "examples"))
    from mingpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4, block_size=32)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (4, config.block_size))
    targets = torch.randint(0, config.vocab_size, (4, config.block_size))
    compiled = torch.compile(model, backend="tpucompile")
    _barrier(pathlib.Path(args.barrier), args.wave_size)
    loss = compiled(idx, targets)
    loss.backward()
    eager = model(idx, targets)
    caches = [c for c in artifacts.stores._caches.values() if c is not None]
    described = caches[0].describe() if caches else {}
    print(json.dumps({
        "ok": bool(torch.allclose(loss, eager, rtol=1e-4, atol=1e-4)),
        "seconds": time.perf_counter() - start,
        "xla_compile_s": compile_seconds[0],
        "stats": tpucompile.stats()["total"],
        "remote": described.get("remote"),
        "fleet": described.get("fleet"),
    }), flush=True)


def _barrier(folder: pathlib.Path, count: int) -> None:
    (folder / f"ready-{os.getpid()}").touch()
    deadline = time.time() + 600
    while len(list(folder.glob("ready-*"))) < count and time.time() < deadline:
        time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(folder: pathlib.Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
    port = _free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                               "no", "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit("redis-server did not start")


def run_fleet(root: pathlib.Path, remote: str | None, args: argparse.Namespace) -> tuple[list[dict], float]:
    """Every host's report and the fleet's wall time."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TPUCOMPILE_CACHE")}
    reports = []
    start = time.perf_counter()
    for first in range(0, args.hosts, args.wave):
        size = min(args.wave, args.hosts - first)
        barrier = root / f"wave-{first}"
        barrier.mkdir(parents=True)
        processes = []
        for host in range(first, first + size):
            env = {**base, "TPUCOMPILE_CACHE_DIR": str(root / f"host-{host}")}
            if remote:
                env["TPUCOMPILE_CACHE_REMOTE"] = remote
            command = [sys.executable, __file__, "--child", "--barrier", str(barrier), "--wave-size", str(size),
                       "--layers", str(args.layers), "--width", str(args.width)]
            processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
        for process in processes:
            out, err = process.communicate(timeout=1800)
            if process.returncode:
                raise SystemExit(f"a host failed:\n{err[-4000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports, time.perf_counter() - start


def summary(name: str, reports: list[dict], wall: float) -> dict:
    compiles = sum(r["stats"]["compiles"] for r in reports)
    hits: dict[str, int] = {}
    for report in reports:
        for tier, count in report["stats"]["hits"].items():
            hits[tier] = hits.get(tier, 0) + count
    waited = sum((r["fleet"] or {}).get("waited", 0) for r in reports)
    errors = sum((r["remote"] or {}).get("errors", 0) for r in reports)
    seconds = sorted(r["seconds"] for r in reports)
    xla = sum(r["xla_compile_s"] for r in reports)
    print(f"{name}: {compiles} executables compiled ({xla:.1f}s in XLA), loaded {hits or 'none'}, wall {wall:.1f}s, "
          f"host median {seconds[len(seconds) // 2]:.1f}s, lease waits {waited}, remote errors {errors}, "
          f"all correct: {all(r['ok'] for r in reports)}")
    return {"compiles": compiles, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    parser.add_argument("--wave-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=32)
    parser.add_argument("--wave", type=int, default=8, help="hosts started together")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.hosts < 1 or args.wave < 1:
        raise SystemExit("--hosts and --wave must be at least 1")
    waves = -(-args.hosts // args.wave)
    print(f"{args.hosts} simulated hosts (fresh processes, empty cache directories of their own), in {waves} "
          f"wave(s) of up to {args.wave} started together on {os.cpu_count()} cores; GPT {args.layers} blocks, "
          f"width {args.width}, one training step (forward + backward graphs), CPU")
    with tempfile.TemporaryDirectory(prefix="tpucompile-fleet-") as tmp:
        root = pathlib.Path(tmp)
        server, url = start_redis(root)
        try:
            remote = summary("redis remote tier", *run_fleet(root / "redis", url, args))
        finally:
            server.kill()
            server.wait()
        alone = summary("no remote tier   ", *run_fleet(root / "alone", None, args))
    print(f"no remote / redis: compiles {alone['compiles'] / max(1, remote['compiles']):.1f}x, "
          f"wall time {alone['wall'] / remote['wall']:.2f}x")


if __name__ == "__main__":
    main()
