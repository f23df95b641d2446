"""The host kernels' per-op decisions for the benchmark's workloads: every dot and convolution they could take,
timed both ways on this machine, and which way each went.

    python bench/kernel_choices.py [--models gpt-384,resnet18,densenet121] [--modes inference,train]

Each workload is compiled (forward, and backward for train) with ``host_kernels="auto"`` in this process,
against a fresh decision file (a temporary ``TPUCOMPILE_BUILD_DIR``), so every op is timed now. Prints one
row per op (XLA's time, the host kernel's, their ratio, the choice) and, per workload, how many ops the
kernels could take and how many they won. The step-time effect of those choices in whole programs is
``bench/run.py``'s tpucompile / tpucompile-xla column.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt-384,resnet18,densenet121")
    parser.add_argument("--modes", default="inference,train")
    args = parser.parse_args()
    build = tempfile.mkdtemp(prefix="tpucompile-choices-")
    os.environ["TPUCOMPILE_BUILD_DIR"] = build
    os.environ["TPUCOMPILE_CACHE_MODE"] = "off"
    os.environ["TPUCOMPILE_HOST_KERNELS"] = "auto"
    sys.path.insert(0, str(HERE))
    import torch
    from models import build as build_workload

    from tpucompile.runtime.host_kernels import kernel_choice

    seen: set[str] = set()
    print("| workload | op | XLA us: median (best) | host us: median (best) | host / XLA (medians) | choice |\n"
          "|---|---|---:|---:|---:|---|")
    summary = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            torch._dynamo.reset()
            workload = build_workload(model)
            net = workload.model
            if mode == "inference" and workload.eval_for_inference:
                net.eval()
            compiled = torch.compile(net, backend="tpucompile")
            if mode == "inference":
                with torch.no_grad():
                    compiled(*workload.inputs)
            else:
                workload.loss(compiled).backward()
            decisions = json.loads(kernel_choice.decisions_path().read_text())
            new = {sign: d for sign, d in decisions.items() if sign not in seen}
            seen.update(new)
            for d in sorted(new.values(), key=lambda d: -d["xla_median_us"]):
                print(f"| {model} {mode} | `{d['op']}` | {d['xla_median_us']:.0f} ({d['xla_min_us']:.0f}) | "
                      f"{d['host_median_us']:.0f} ({d['host_min_us']:.0f}) | "
                      f"{d['host_median_us'] / d['xla_median_us']:.2f} | {'host' if d['host'] else 'XLA'} |")
            won = sum(d["host"] for d in new.values())
            summary.append(f"| {model} | {mode} | {len(new)} | {won} |")
    print("\n| workload | mode | ops the kernels could take (new in this workload) | ops the kernels won |")
    print("|---|---|---:|---:|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
