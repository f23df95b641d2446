"""Run PyTorch's ModuleInfo database (``common_modules.module_db``) through ``backend="tpucompile"``.

    python tests/moduleinfo/sweep.py --modes train eval --json modules.json --markdown-section coverage.md

Each module sample (its constructor's and its forward's inputs) is built twice from one seed: once run
eagerly, once through ``torch.compile(..., backend="tpucompile", fullgraph=True)``. In ``train`` mode the
module is in training mode, its float inputs require grad, and a loss weighting every output element
differently is backpropagated: the outputs, the inputs' gradients, the parameters' gradients and the buffers
(BatchNorm's running statistics) are compared. In ``eval`` mode the module is in eval mode under
``torch.no_grad()`` (PyTorch's own inference fast paths, ``_native_multi_head_attention`` among them, run
there) and the outputs are compared. ``--dtype bfloat16`` casts module and inputs, and ``--autocast``
runs both under ``torch.autocast("cpu", torch.bfloat16)``.

Outcomes are the OpInfo sweep's (``tests/opinfo/sweep.py``): ``pass``, ``mismatch``, ``unsupported``,
``crash``, ``dynamo`` (Dynamo could not capture the call), ``no-graph``, ``random`` (eager itself differs
between two seeds: dropout) and ``eager-error`` (eager PyTorch raises on the sample: not a test of ours).
Comparisons allow an error of ``rtol`` of each value plus ``atol`` times the largest magnitude of that tensor
where it is over 1 (gradients of a sum over many elements grow with it, so a fixed bound alone says little);
the defaults are per dtype, and a family that eager computes with a different reduction order than
XLA may set its own (``FAMILY_TOLERANCES``, each with its measured reason).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.opinfo.sweep import classify_error
from tpucompile import driver

OUTCOMES = ("pass", "mismatch", "unsupported", "crash", "dynamo", "no-graph", "random", "eager-error")
COUNTED = ("pass", "mismatch", "unsupported", "crash")

TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
"""(rtol of each value, atol) per dtype; atol is scaled by the tensor's largest magnitude where that is over 1."""

FAMILY_TOLERANCES = {
    # Per-instance statistics over few elements with eps: eager's two-pass variance and XLA's differ in the
    # last bits, which the backward's 1/std amplifies; Inductor differs from eager by ~5e-3 of the largest
    # gradient on these samples too.
    "nn.InstanceNorm1d": (1e-3, 5e-3),
    "nn.InstanceNorm2d": (1e-3, 5e-3),
    "nn.InstanceNorm3d": (1e-3, 5e-3),
}


@dataclasses.dataclass
class SampleResult:
    module: str
    mode: str
    dtype: str
    index: int
    outcome: str
    detail: str = ""


def load_module_db() -> list[Any]:
    from torch.testing._internal.common_modules import module_db

    return list(module_db)


def _tolerance(name: str, dtype: torch.dtype) -> tuple[float, float]:
    rtol, atol = TOLERANCES[dtype]
    family = FAMILY_TOLERANCES.get(name)
    return (max(rtol, family[0]), max(atol, family[1])) if family else (rtol, atol)


def _close(actual: Any, expected: Any, rtol: float, atol: float, what: str) -> str | None:
    flat_a, spec_a = pytree.tree_flatten(actual)
    flat_e, spec_e = pytree.tree_flatten(expected)
    if spec_a != spec_e:
        return f"{what}: structure {spec_a} != {spec_e}"
    for index, (a, e) in enumerate(zip(flat_a, flat_e, strict=True)):
        if not isinstance(e, torch.Tensor):
            if a != e:
                return f"{what}[{index}]: {a!r} != {e!r}"
            continue
        if not isinstance(a, torch.Tensor):
            return f"{what}[{index}]: expected a tensor, got {type(a).__name__}"
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"{what}[{index}]: {a.dtype} {list(a.shape)} != {e.dtype} {list(e.shape)}"
        if not e.is_floating_point():
            if not torch.equal(a, e):
                return f"{what}[{index}]: values differ"
            continue
        finite = e[torch.isfinite(e)]
        scale = finite.abs().max().item() if finite.numel() else 1.0
        try:
            torch.testing.assert_close(a.float(), e.float(), rtol=rtol, atol=atol * max(scale, 1.0),
                                       equal_nan=True)
        except AssertionError as error:
            lines = [line.strip() for line in str(error).splitlines() if "difference" in line]
            return f"{what}[{index}] (largest {scale:.3g}): {'; '.join(lines)[:240]}"
    return None


def _float_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _materialize(tree: Any, dtype: torch.dtype, grad: bool) -> Any:
    """Fresh copies of the sample's tensors: floats cast to ``dtype`` and, with ``grad``, leaves requiring it
    where the sample's do (a loss's target does not)."""
    def copy_one(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        fresh = value.detach().clone()
        if fresh.is_floating_point():
            fresh = fresh.to(dtype)
            if grad and value.requires_grad:
                fresh.requires_grad_(True)
        return fresh

    return pytree.tree_map(copy_one, tree)


def _loss(outputs: Any) -> torch.Tensor | None:
    """A sum over every float output that weights each element differently, so that a gradient sent to the
    wrong element shows."""
    tensors = [t for t in _float_leaves(outputs) if t.requires_grad]
    if not tensors:
        return None
    return sum((t.float() * torch.linspace(-1.0, 2.0, t.numel()).reshape(t.shape)).sum() for t in tensors)


@dataclasses.dataclass
class _Run:
    outputs: Any
    grads: list[Any]
    parameter_grads: list[Any]
    buffers: list[torch.Tensor]


def _run(module: torch.nn.Module, sample: Any, mode: str, dtype: torch.dtype, autocast: bool,
         call: Callable[..., Any]) -> _Run:
    train = mode == "train"
    args = _materialize(sample.forward_input.args, dtype, train)
    kwargs = _materialize(sample.forward_input.kwargs, dtype, train)
    context = torch.autocast("cpu", torch.bfloat16) if autocast else _nothing()
    with context, torch.set_grad_enabled(train):
        outputs = call(*args, **kwargs)
    grads: list[Any] = []
    parameter_grads: list[Any] = []
    if train:
        loss = _loss(outputs)
        if loss is not None:
            loss.backward()
        grads = [t.grad for t in _float_leaves((args, kwargs))]
        parameter_grads = [p.grad for p in module.parameters()]
    return _Run(pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, outputs), grads,
                parameter_grads, [b.detach().clone() for b in module.buffers()])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _build(info: Any, sample: Any, mode: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    args = _materialize(sample.constructor_input.args, dtype, False)
    kwargs = _materialize(sample.constructor_input.kwargs, dtype, False)
    module = info.module_cls(*args, **kwargs).to(dtype).train(mode == "train")
    if info.is_lazy:  # its parameters take their shapes, and their random values, from a first call
        with torch.no_grad():
            module(*_materialize(sample.forward_input.args, dtype, False),
                   **_materialize(sample.forward_input.kwargs, dtype, False))
        module.zero_grad()
    return module


def _differs(first: _Run, second: _Run) -> bool:
    return _close(first.outputs, second.outputs, 1e-5, 1e-6, "outputs") is not None


def run_sample(info: Any, sample: Any, index: int, mode: str, dtype: torch.dtype, autocast: bool = False
               ) -> SampleResult:
    """One sample's outcome (see the module doc)."""
    result = _result_maker(info.name, mode, dtype, index, autocast)
    try:
        eager_module = _build(info, sample, mode, dtype, 0)
        pristine = copy.deepcopy(eager_module)
        torch.manual_seed(0)
        expected = _run(eager_module, sample, mode, dtype, autocast, eager_module)
        again = copy.deepcopy(pristine)
        torch.manual_seed(1)
        if _differs(expected, _run(again, sample, mode, dtype, autocast, again)):
            return result("random", "eager gives other outputs under another seed")
    except Exception as error:
        return result("eager-error", f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    compiled_module = copy.deepcopy(pristine)
    torch._dynamo.reset()
    before = driver.graphs_compiled()
    try:
        compiled = torch.compile(compiled_module, backend="tpucompile", fullgraph=True)
        torch.manual_seed(0)
        actual = _run(compiled_module, sample, mode, dtype, autocast, compiled)
    except Exception as error:
        return result(*classify_error(error))
    if driver.graphs_compiled() == before:
        return result("no-graph", "")
    rtol, atol = _tolerance(info.name, torch.bfloat16 if autocast else dtype)
    for what, a, e in (("outputs", actual.outputs, expected.outputs), ("input grads", actual.grads, expected.grads),
                       ("parameter grads", actual.parameter_grads, expected.parameter_grads),
                       ("buffers", actual.buffers, expected.buffers)):
        reason = _close(a, e, rtol, atol, what)
        if reason is not None:
            return result("mismatch", reason)
    return result("pass", "")


def _result_maker(name: str, mode: str, dtype: torch.dtype, index: int, autocast: bool
                  ) -> Callable[[str, str], SampleResult]:
    dtype_name = str(dtype).removeprefix("torch.") + ("+autocast" if autocast else "")
    return lambda outcome, detail: SampleResult(name, mode, dtype_name, index, outcome, detail)


def samples(info: Any, mode: str, dtype: torch.dtype) -> list[Any]:
    torch.manual_seed(0)
    return list(info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=mode == "train",
                                        training=mode == "train"))


def sweep(db: Iterable[Any], modes: Iterable[str], dtype: torch.dtype, max_samples: int, autocast: bool = False,
          only: set[str] | None = None, progress: bool = False) -> list[SampleResult]:
    results = []
    for info in db:
        if only and info.name not in only:
            continue
        if dtype not in info.dtypes and not autocast:
            continue
        for mode in modes:
            try:
                found = samples(info, mode, dtype if not autocast else torch.float32)
            except Exception as error:
                results.append(_result_maker(info.name, mode, dtype, 0, autocast)("eager-error", str(error)[:200]))
                continue
            for index, sample in enumerate(found[:max_samples]):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    started = time.perf_counter()
                    result = run_sample(info, sample, index, mode, dtype if not autocast else torch.float32,
                                        autocast)
                results.append(result)
                if progress:
                    print(f"{time.perf_counter() - started:6.1f}s {result.module} {mode} {index}: {result.outcome}"
                          f" {result.detail[:160]}", flush=True)
    return results


def summarize(results: list[SampleResult]) -> dict[str, dict[str, int]]:
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        totals[f"{r.mode} {r.dtype}"][r.outcome] += 1
    return {key: dict(counter) for key, counter in sorted(totals.items())}


def pass_rate(counter: dict[str, int]) -> float:
    counted = sum(counter.get(o, 0) for o in COUNTED)
    return counter.get("pass", 0) / counted if counted else 0.0


def markdown(results: list[SampleResult]) -> str:
    lines = ["| mode | dtype | " + " | ".join(OUTCOMES) + " | pass rate |",
             "|---|---|" + "---|" * len(OUTCOMES) + "---|"]
    for key, counter in summarize(results).items():
        mode, dtype = key.split(" ")
        lines.append(f"| {mode} | {dtype} | " + " | ".join(str(counter.get(o, 0)) for o in OUTCOMES)
                     + f" | {100 * pass_rate(counter):.1f}% |")
    failing = [r for r in results if r.outcome in ("mismatch", "unsupported", "crash", "dynamo", "random",
                                                   "eager-error")]
    if failing:
        lines += ["", "| module | mode | dtype | sample | outcome | reason |", "|---|---|---|---|---|---|"]
        for r in failing:
            detail = r.detail.replace("|", "/").replace("\n", " ")[:200]
            lines.append(f"| {r.module} | {r.mode} | {r.dtype} | {r.index} | {r.outcome} | {detail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["train", "eval"], choices=["train", "eval"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--autocast", action="store_true", help="float32 modules under bfloat16 autocast")
    parser.add_argument("--max-samples", type=int, default=2)
    parser.add_argument("--modules", nargs="*", help="only these ModuleInfo names (nn.Linear ...)")
    parser.add_argument("--json", help="write every sample's outcome here")
    parser.add_argument("--markdown", help="write the summary table here")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TPUCOMPILE_FALLBACK", "error")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    results = sweep(load_module_db(), args.modes, dtype, args.max_samples, args.autocast,
                    set(args.modules) if args.modules else None, progress=not args.quiet)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([dataclasses.asdict(r) for r in results], out, indent=0)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(markdown(results))
    for key, counter in summarize(results).items():
        print(f"{key}: {counter} pass rate {100 * pass_rate(counter):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
