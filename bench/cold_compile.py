"""Where the cold first call of a training step spends its time, phase by phase.

    python bench/cold_compile.py [--workloads gpt24,densenet121,qwen3_moe,vae]
        [--backends tpucompile:background,tpucompile:inline,inductor] [--fresh-machine] [--json FILE]

Each workload runs in a new process with an empty compile cache (the machine's host-kernel decisions are kept,
as on any machine that has compiled before; ``--fresh-machine`` starts each process with none): one training
step, the forward with its loss and the backward, timed from the call to the end of ``backward()``; then the
steady step (median of 3), and for tpucompile again once the background compiles are done (``background s``:
how long the process then still waited for them) and the programs' host-kernel trials decided (12 steps).
The phases are the exclusive wall time of the functions that start them (a phase nested in another counts
only in the inner one):

* ``dynamo``: TorchDynamo's bytecode trace, guards and the parts of AOTAutograd not listed below;
* ``aot trace``: AOTAutograd's joint forward-backward trace, with the decompositions;
* ``partition``: the min-cut split of the joint graph into forward and backward;
* ``ours``: tpucompile's graph passes, keys, caches and executable assembly (``compile_graph`` less the
  three below);
* ``lowering``: ATen graph to StableHLO;
* ``host timing``: timing host kernels against XLA's ops (zero where the machine's decisions are known);
* ``xla``: XLA's compile through PJRT;
* ``other``: the first runs of both programs, autograd's engine and Python around them.

``tpucompile:inline`` and ``tpucompile:background`` set ``host_kernel_timing``, ``tpucompile:roll_layers=false``
(any ``name=value``, several joined by ``:``) another option; ``inductor`` is Inductor's cold first call of the
same step (empty Inductor cache), for scale.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

PHASES = (
    ("dynamo", "torch._dynamo.convert_frame", "_compile"),
    ("aot trace", "torch._functorch._aot_autograd.graph_compile", "aot_stage1_graph_capture"),
    ("partition", "torch._functorch.partitioners", "min_cut_rematerialization_partition"),
    ("ours", "tpucompile.driver.graphs", "compile_graph"),
    ("lowering", "tpucompile.artifacts.programs", "lowered_program"),
    ("host timing", "tpucompile.runtime.host_kernels.kernel_choice", "chosen_ops"),
    ("xla", "tpucompile.runtime.compiler", "compile_module"),
)


class PhaseClock:
    """Exclusive wall time per phase on the calling (main) thread: each wrapped function's time less that of
    wrapped functions it calls. Work on other threads (the background host-kernel timing) is not counted."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self._open: list[list] = []

    def wrap(self, phase: str, function: Callable) -> Callable:
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return function(*args, **kwargs)
            start = time.perf_counter()
            self._open.append([phase, 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                _, inner = self._open.pop()
                spent = time.perf_counter() - start
                self.seconds[phase] += spent - inner
                if self._open:
                    self._open[-1][1] += spent

        return timed

    def install(self) -> None:
        """Wrap each phase's function wherever a loaded module holds it (callers import it by name)."""
        import tpucompile.backend
        import tpucompile.frontend.activation_budget  # noqa: F401

        for phase, module_name, name in PHASES:
            original = getattr(importlib.import_module(module_name), name)
            timed = self.wrap(phase, original)
            for module in list(sys.modules.values()):
                if getattr(module, name, None) is original:
                    setattr(module, name, timed)


def gpt24() -> tuple[torch.nn.Module, Callable]:
    """24 blocks of width 256 (8 heads), 4 x 128 tokens: a deep, narrow GPT, where depth is the cost."""
    from mingpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=8192, block_size=128, n_layer=24, n_head=8, n_embd=256)
    idx = torch.randint(0, config.vocab_size, (4, config.block_size))
    targets = torch.randint(0, config.vocab_size, (4, config.block_size))
    return GPT(config), lambda net: net(idx, targets)


def densenet121() -> tuple[torch.nn.Module, Callable]:
    """DenseNet-121's layout (the example's definition) on 8 images of 64 x 64."""
    from densenet import DENSENET_121, DenseNet

    model = DenseNet(DENSENET_121)
    images = torch.randn(8, DENSENET_121.in_channels, DENSENET_121.image_size, DENSENET_121.image_size)
    labels = torch.randint(0, DENSENET_121.num_classes, (8,))
    return model, lambda net: F.cross_entropy(net(images), labels)


def qwen3_moe() -> tuple[torch.nn.Module, Callable]:
    """Hugging Face's Qwen3-MoE, 2 layers of width 256, 8 experts of 128, top 2, 2 x 64 tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=8, num_experts_per_tok=2)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    return Qwen3MoeForCausalLM(config), lambda net: net(input_ids=ids, labels=ids).loss


def vae() -> tuple[torch.nn.Module, Callable]:
    """diffusers' ``AutoencoderKL`` at Stable Diffusion's layout (128-256-512-512), 1 image of 64 x 64."""
    from diffusers import AutoencoderKL

    model = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                          down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    images = torch.randn(1, 3, 64, 64)
    return model, lambda net: F.mse_loss(net(images).sample, images)


WORKLOADS = {"gpt24": gpt24, "densenet121": densenet121, "qwen3_moe": qwen3_moe, "vae": vae}


def measure_one(name: str, backend: str, decisions: str | None) -> dict:
    """In this (new) process: one cold training step of ``name`` under ``backend``, with its phases; then the
    steady step, before and after the background host-kernel timing has swapped its programs in."""
    clock = PhaseClock()
    if backend.startswith("tpucompile"):
        clock.install()
        if decisions:  # a machine that has timed nothing yet
            from tpucompile.runtime.host_kernels import kernel_choice

            kernel_choice.decisions_path = lambda: __import__("pathlib").Path(decisions)
    torch.manual_seed(0)
    model, loss_of = WORKLOADS[name]()
    compiled = torch.compile(model, backend=backend.partition(":")[0], options=_options(backend) or None)
    start = time.perf_counter()
    loss_of(compiled).backward()
    first = time.perf_counter() - start
    steady = _step_seconds(compiled, loss_of)
    row = {"workload": name, "backend": backend, "first_call_s": round(first, 3), "steady_step_s": steady,
           "phases": {}}
    if backend.startswith("tpucompile"):
        from tpucompile.driver import host_kernel_upgrades

        start = time.perf_counter()
        host_kernel_upgrades.wait()
        row["background_s"] = round(time.perf_counter() - start, 3)
        for _ in range(host_kernel_upgrades.TRIAL_CALLS):  # the trials' calls
            loss_of(compiled).backward()
        row["decided"] = list(host_kernel_upgrades.decided)
        row["steady_step_after_s"] = _step_seconds(compiled, loss_of)
        row["phases"] = {phase: round(clock.seconds[phase], 3) for phase, _, _ in PHASES}
        row["phases"]["other"] = round(first - sum(row["phases"].values()), 3)
    return row


def _options(backend: str) -> dict:
    """tpucompile's options from a backend spec: ``tpucompile:inline`` sets ``host_kernel_timing``,
    ``tpucompile:roll_layers=false`` any option (several separated by ``:``)."""
    options: dict = {}
    for part in backend.split(":")[1:]:
        name, equals, value = part.partition("=")
        if not equals:
            options["host_kernel_timing"] = name
        else:
            options[name] = {"true": True, "false": False}.get(value.lower(), value)
    return options


def _step_seconds(compiled: Callable, loss_of: Callable, steps: int = 3) -> float:
    """The median of ``steps`` training steps' wall time."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss_of(compiled).backward()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[len(times) // 2], 4)


def _in_new_process(name: str, backend: str, fresh_machine: bool) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        environ = dict(os.environ, TPUCOMPILE_CACHE_DIR=os.path.join(scratch, "cache"),
                       TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"))
        command = [sys.executable, __file__, "--one", name, "--backend", backend]
        if fresh_machine:
            command += ["--decisions", os.path.join(scratch, "decisions.json")]
        done = subprocess.run(command, env=environ, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"workload": name, "backend": backend, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(rows: list[dict]) -> str:
    names = [phase for phase, _, _ in PHASES] + ["other"]
    head = ("| workload | backend | first call s | " + " | ".join(names)
            + " | steady step s | background s | steady step after s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['workload']} | {row['backend']} | failed: {row['error']} |")
            continue
        phases = row["phases"]
        cells = [f"{phases[n]:.2f} ({100 * phases[n] / row['first_call_s']:.0f}%)" for n in names] if phases \
            else ["" for _ in names]
        after = [f"{row[k]:.3f}" if k in row else "" for k in ("background_s", "steady_step_after_s")]
        lines.append(f"| {row['workload']} | {row['backend']} | {row['first_call_s']:.2f} | " + " | ".join(cells)
                     + f" | {row['steady_step_s']:.3f} | " + " | ".join(after) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--backends", default="tpucompile",
                        help="comma-separated: tpucompile, tpucompile:inline, tpucompile:background, inductor")
    parser.add_argument("--fresh-machine", action="store_true",
                        help="each process starts with no host-kernel decisions (a machine that timed nothing)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="tpucompile", help=argparse.SUPPRESS)
    parser.add_argument("--decisions", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.backend, args.decisions)))
        return
    rows = []
    for name in args.workloads.split(","):
        for backend in args.backends.split(","):
            rows.append(_in_new_process(name, backend, args.fresh_machine))
            print(json.dumps(rows[-1]), flush=True)
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
