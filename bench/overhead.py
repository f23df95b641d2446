"""Per-call overhead of a compiled graph, measured in one run against eager, Inductor and a raw PJRT execute.

    python bench/overhead.py [--repeat N]

Two graphs: a tiny one (one input, one output) where the call overhead is everything, and the small GPT of
``examples/mingpt.py`` with two blocks (27 parameter inputs). For tpucompile it reports three numbers:

* ``torch.compile`` call — what a user's call costs: Dynamo's guards, AOTAutograd's wrapper, our callable;
* callable — the time inside the callable tpucompile hands back (input exchange, execute, output exchange),
  with the activation input a *different* tensor on every call and the parameters unchanged;
* raw execute — ``LoadedExecutable.execute`` of the same executable on device buffers prepared beforehand.

Target: callable <= 2 x raw execute + 2 us x (number of inputs and outputs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from mingpt import GPT, GPTConfig

from tpucompile import driver


def _time_per_call(fn, repeat: int, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean time of ``repeat`` calls, in microseconds."""
    for _ in range(max(10, repeat // 10)):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        samples.append((time.perf_counter() - start) / repeat * 1e6)
    return statistics.median(samples)


def _capture_call(model, inputs):
    """Run the compiled model once and return (our executable, the argument list AOTAutograd passed it)."""
    before = len(driver.recent_executables())
    model(*inputs)
    executable = driver.recent_executables()[-1]
    assert len(driver.recent_executables()) > before or executable is not None
    captured = []
    original = executable.buffers

    def spy(args):
        captured.append(list(args))
        return original(args)

    executable.buffers = spy
    try:
        model(*inputs)
    finally:
        del executable.buffers
    return executable, captured[-1]


def measure(name, module, make_input, repeat):
    module.eval()
    pool = [make_input() for _ in range(16)]
    rows = {}
    with torch.no_grad():
        torch._dynamo.reset()
        inductor = torch.compile(module, backend="inductor")
        inductor(pool[0])
        ours = torch.compile(module, backend="tpucompile")
        ours(pool[0])
        executable, args = _capture_call(ours, [pool[0]])
        activation_slots = [i for i, a in enumerate(args) if any(a is p for p in pool)]

        counter = iter(range(10**12))

        def fresh_args():
            new = list(args)
            x = pool[next(counter) % len(pool)]
            for slot in activation_slots:
                new[slot] = x
            return new

        arg_sets = [fresh_args() for _ in range(len(pool))]
        cycle = iter(range(10**12))
        buffers = executable.buffers(args)
        loaded = executable.loaded
        n_io = len(executable.input_positions) + len(executable.output_plan)

        def call_in(fn):
            def run():
                fn(pool[next(cycle) % len(pool)])
            return run

        dynamo_eager = torch.compile(module, backend="eager")
        dynamo_eager(pool[0])
        rows["eager"] = _time_per_call(call_in(module), repeat)
        rows["dynamo eager backend"] = _time_per_call(call_in(dynamo_eager), repeat)
        rows["inductor"] = _time_per_call(call_in(inductor), repeat)
        rows["tpucompile (torch.compile call)"] = _time_per_call(call_in(ours), repeat)
        rows["tpucompile callable"] = _time_per_call(lambda: executable(arg_sets[next(cycle) % len(arg_sets)]), repeat)
        rows["raw PJRT execute"] = _time_per_call(lambda: loaded.execute(buffers), repeat)
    budget = 2 * rows["raw PJRT execute"] + 2 * n_io
    return rows, n_io, budget


def measure_bucketed(module, make_input, repeat) -> dict[str, float]:
    """The tiny graph with its dimension 0 dynamic: Dynamo's eager backend against tpucompile per size (one
    executable for the size) and on buckets (the size padded to its bucket and the result cut back)."""
    module.eval()
    pool = [make_input() for _ in range(16)]
    for x in pool:
        torch._dynamo.mark_dynamic(x, 0)
    rows = {}
    cycle = iter(range(10**12))
    with torch.no_grad():
        for name, backend, options in (("dynamo eager backend", "eager", None),
                                       ("tpucompile exact", "tpucompile", None),
                                       ("tpucompile bucket", "tpucompile", {"dynamic_mode": "bucket"})):
            torch._dynamo.reset()
            compiled = torch.compile(module, backend=backend, options=options)
            compiled(pool[0])
            rows[name] = _time_per_call(lambda c=compiled: c(pool[next(cycle) % len(pool)]), repeat)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return x * 2 + 1

    config = GPTConfig(n_layer=2, n_embd=64, n_head=4)
    gpt = GPT(config)
    parameters = sum(1 for _ in gpt.parameters())
    cases = [
        ("tiny graph (1 input)", Tiny(), lambda: torch.randn(16)),
        (f"GPT, 2 blocks ({parameters} parameter inputs, 1x32 tokens)", gpt,
         lambda: torch.randint(0, config.vocab_size, (1, 32))),
    ]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; microseconds per call (median of 7 rounds)\n")
    print("| graph | eager | Dynamo eager backend | inductor | tpucompile call | over Dynamo eager "
          "| tpucompile callable | raw execute | inputs+outputs | budget (2x raw + 2us each) | within budget |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, module, make_input in cases:
        repeat = args.repeat if "tiny" in name else max(100, args.repeat // 10)
        rows, n_io, budget = measure(name, module, make_input, repeat)
        ok = rows["tpucompile callable"] <= budget
        call = rows["tpucompile (torch.compile call)"]
        print(f"| {name} | {rows['eager']:.1f} | {rows['dynamo eager backend']:.1f} | {rows['inductor']:.1f} | "
              f"{call:.1f} | +{call - rows['dynamo eager backend']:.1f} | {rows['tpucompile callable']:.1f} | "
              f"{rows['raw PJRT execute']:.1f} | {n_io} | {budget:.1f} | {'yes' if ok else 'NO'} |")
    rows = measure_bucketed(Tiny(), lambda: torch.randn(13, 16), args.repeat)
    print("\nThe tiny graph with a dynamic dimension (13 rows; bucket 16), microseconds per call:\n")
    print("| Dynamo eager backend | tpucompile exact | over Dynamo eager | tpucompile bucket | over Dynamo eager |")
    print("|---|---|---|---|---|")
    base = rows["dynamo eager backend"]
    print(f"| {base:.1f} | {rows['tpucompile exact']:.1f} | +{rows['tpucompile exact'] - base:.1f} | "
          f"{rows['tpucompile bucket']:.1f} | +{rows['tpucompile bucket'] - base:.1f} |")


if __name__ == "__main__":
    main()
