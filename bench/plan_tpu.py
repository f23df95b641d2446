"""Plan a TPU-scale training step on this machine: a Llama-shaped model on meta weights (no host memory is
spent on them), its forward, backward and AdamW step compiled for a TPU slice that is not here, sharded with
FSDP (or FSDP x TP), and the step report: bytes per chip by use, whether it fits, estimated time and MFU.

    python bench/plan_tpu.py --model 8b --target tpu:v5p:4x4x4 --mesh data=64 --shard fsdp --batch 64
    python bench/plan_tpu.py --model 8b --target tpu:v5e:4x4 --mesh data=4,model=4 --shard fsdp+tp --batch 16
    TPUCOMPILE_ROLL_LAYERS=1 python bench/plan_tpu.py --model 405b --target tpu:v5p:4x8x8 --mesh data=32,model=8 \
        --shard fsdp+tp --batch 32

Prints the wall time to trace and compile every graph, the process's peak resident memory (and, at the
highest of twice-a-second samples, how much of it is heap and how much mapped library code), and the step
report (``--json FILE`` writes them). The model is ``examples/llama.py``'s at the named shape, in bfloat16
(parameters, gradients and AdamW's state alike), trained on ``--length`` tokens per sequence.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import sys
import threading
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

from llama import Llama, LlamaConfig

import tpucompile
from tpucompile import driver
from tpucompile.contracts.input_uses import BUDGET_KEY
from tpucompile.contracts.target_names import GENERATIONS
from tpucompile.debug.step_report import format_step_report, step_report
from tpucompile.debug.uses import graph_uses
from tpucompile.runtime.host_memory import limit_heap_arenas

SHAPES = {
    "8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336),
    "70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672),
    "405b": dict(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, hidden_dim=53248),
    "tiny": dict(vocab_size=32000, dim=512, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=1408),
}
"""Llama 3 8B, 70B and 405B as their configs give them; ``tiny`` for a quick try."""

COLUMN = ["layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv", "layers.*.feed_forward.w1",
          "layers.*.feed_forward.w3"]
ROW = ["layers.*.attention.wo", "layers.*.feed_forward.w2"]


def plan(mesh: tpucompile.Mesh, shard: str) -> tpucompile.ShardPlan:
    if shard == "fsdp":
        return tpucompile.fully_sharded(mesh)
    if shard == "fsdp+tp":
        return tpucompile.fully_sharded(mesh) + tpucompile.tensor_parallel(mesh, column=COLUMN, row=ROW)
    raise SystemExit(f"--shard is fsdp or fsdp+tp, not {shard!r}")


class _PeakSampler:
    """Samples the resident memory twice a second and keeps its split at the highest sample: anonymous memory
    (heap: what the compile and the process hold) against mapped files (the code of libtpu, torch and jaxlib,
    which counts in the resident size but is shared and re-readable)."""

    def __init__(self) -> None:
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            fields = _resident()
            if fields.get("VmRSS", 0) > self.peak["VmRSS"]:
                self.peak.update(fields)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def _resident() -> dict[str, int]:
    """This process's resident memory now, in bytes (Linux): in all (``VmRSS``), anonymous and mapped files."""
    with open("/proc/self/status") as status:
        return {key: int(value.split()[0]) * 1024 for key, value in (line.split(":", 1) for line in status)
                if key in ("VmRSS", "RssAnon", "RssFile")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, help="override the shape's layer count")
    parser.add_argument("--target", default="tpu:v5p:4x4x4")
    parser.add_argument("--mesh", default="data=64")
    parser.add_argument("--shard", default="fsdp")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step (global)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--cache-dir", help="store the executables here (default: the cache off)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    limit_heap_arenas()  # as `tpucompile warm --target` does for itself

    shape = dict(SHAPES[args.model], max_seq_len=args.length, rope_theta=500000.0)
    if args.layers:
        shape["n_layers"] = args.layers
    mesh = tpucompile.Mesh.parse(args.mesh)
    options = {"targets": [args.target], "mesh": mesh, "shard": plan(mesh, args.shard),
               **({"cache_dir": args.cache_dir} if args.cache_dir else {"cache_mode": "off"})}
    graphs: list[dict] = []

    def observe(event: driver.CompileEvent) -> None:
        """Keep the figures, not the event: it holds the compiled executable (its code alone is gigabytes)."""
        if event.target == args.target:
            graphs.append({"name": event.name, "role": event.name.rsplit("(", 1)[-1].split(")")[0],
                           "uses": graph_uses(event.graph), "report": event.report or {},
                           "activation_budget": event.graph.meta.get(BUDGET_KEY),
                           "error": None if event.error is None else str(event.error),
                           "out_of_memory": event.out_of_memory,
                           "done_at_seconds": time.perf_counter() - start, "host_bytes_then": _resident()["VmRSS"]})

    remove = driver.add_observer(observe)
    sampler = _PeakSampler()
    start = time.perf_counter()
    with torch.device("meta"):
        model = Llama(LlamaConfig(**shape)).to(torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    tokens = torch.zeros(args.batch, args.length, dtype=torch.long, device="meta")
    compiled = torch.compile(model, backend="tpucompile", options=options)
    loss = compiled(tokens, targets=tokens)
    loss.backward()
    # The multi-tensor AdamW, which PyTorch picks by default for parameters on an accelerator (CUDA, XPU,
    # PrivateUse1 devices); meta parameters would get the loop over parameters, a longer trace of the same ops.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    torch.compile(optimizer.step, backend="tpucompile", options=options)()
    seconds = time.perf_counter() - start
    remove()
    sampled = sampler.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the high-water mark: at least any sample
    report = step_report(graphs, args.target)
    model_flops = 6 * parameters * args.batch * args.length
    step = report["estimated_step_seconds"]
    chips = mesh.size
    mfu_6nd = model_flops / (step * chips * GENERATIONS[args.target.split(":")[1]].peak_bf16_flops
                             ) if step else None
    print(f"{args.model} ({parameters / 1e9:.2f} B parameters, {shape['n_layers']} layers), {args.batch} x "
          f"{args.length} tokens, {args.shard} on {mesh!r}, {args.target}")
    print(f"traced and compiled {len(graphs)} graphs in {seconds:.0f} s; peak host memory {rss / 2**30:.2f} GiB; "
          f"at the highest sample ({sampled['VmRSS'] / 2**30:.2f} GiB) {sampled['RssAnon'] / 2**30:.2f} GiB "
          f"anonymous, {sampled['RssFile'] / 2**30:.2f} GiB mapped files (library code)")
    for graph, seen in zip(report["graphs"], [g for g in graphs if not g["error"]], strict=True):
        print(f"  {graph['name']}: peak {graph['memory']['peak'] / 2**30:.2f} GiB per chip, "
              f"{(graph['flops'] or 0) / 1e12:.2f} TFLOP per chip; compiled at {seen['done_at_seconds']:.0f} s, "
              f"host memory then {seen['host_bytes_then'] / 2**30:.2f} GiB")
    print(format_step_report(report))
    if mfu_6nd is not None:
        print(f"  MFU by 6 x parameters x tokens: {mfu_6nd:.0%}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "model": args.model, "shape": shape, "parameters": parameters, "batch": args.batch,
            "length": args.length, "target": args.target, "mesh": args.mesh, "shard": args.shard,
            "seconds": seconds, "peak_host_bytes": rss, "peak_sample": sampled, "report": report,
            "compiled": [{k: g[k] for k in ("name", "done_at_seconds", "host_bytes_then")} for g in graphs],
            "mfu_6nd": mfu_6nd}, indent=1, default=str))


if __name__ == "__main__":
    main()
