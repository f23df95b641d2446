"""Run PyTorch's OpInfo database through ``backend="tpucompile"`` and classify every sample.

    python tests/opinfo/sweep.py --dtypes float32 bfloat16 int64 bool --markdown docs/coverage.md

Each OpInfo sample is called eagerly and through ``torch.compile(..., backend="tpucompile", fullgraph=True)``
and the results compared. Outcomes:

* ``pass``        — results match (for bf16/f16: match eager, or the float32 reference, at bf16 tolerance);
* ``mismatch``    — we compiled and ran it, and the numbers differ;
* ``unsupported`` — we refused it with ``UnsupportedOpError`` (no lowering, or an unsupported dtype);
* ``crash``       — any other error inside tpucompile, XLA or at run time;
* ``dynamo``      — Dynamo could not capture the call (graph break or Dynamo error): not ours;
* ``no-graph``    — Dynamo captured nothing for tpucompile to compile (e.g. the op is a no-op);
* ``random``      — the op is random: eager itself differs between two seeds (tested statistically elsewhere).

Samples on which eager PyTorch itself raises are skipped. Ops whose result is uninitialised memory
(``UNDEFINED_VALUES``) are compared on structure, shape and dtype only, and never counted as random.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from tpucompile import driver
from tpucompile.errors import UnsupportedOpError

OUTCOMES = ("pass", "mismatch", "unsupported", "crash", "dynamo", "no-graph", "random")
COUNTED = ("pass", "mismatch", "unsupported", "crash")
"""Outcomes of samples whose op Dynamo captured: the denominator of the pass rate."""

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
}

UNDEFINED_VALUES = frozenset({
    "empty",
    "new_empty",
    "empty_like",
    "empty_strided",
    "new_empty_strided",
    "empty_permuted",
})
"""OpInfos whose eager result holds uninitialised memory: only the layout (structure, shapes, dtypes) of their
results is defined, so that is all the sweep compares. Their values differ from call to call, which must not
make them count as random ops either."""

_TOLERANCES = {
    torch.float32: (1.3e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
    torch.complex64: (1.3e-5, 1e-5),
}


@dataclasses.dataclass
class SampleResult:
    op: str
    dtype: str
    index: int
    outcome: str
    detail: str = ""


def op_id(opinfo: Any) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def load_op_db() -> list[Any]:
    """PyTorch's OpInfo database, its sample generators told that no unittest test is running (``_no_test_case``)."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.opinfo import core

    common_utils.extract_test_fn = core.extract_test_fn = _no_test_case
    return list(op_db)


def _no_test_case() -> None:
    """What ``extract_test_fn`` finds in these sweeps: no test function. PyTorch's helper looks for a
    ``unittest.TestCase`` up the stack on every ``sample_inputs`` call (twice a call) with ``inspect.stack()``,
    which reads the source lines of every frame: 0.17 s a call here, a fifth of the sweep's time. The sweeps
    are not unittest cases (neither is any test of this suite), so the answer is always None."""
    return None


def _tolerance(opinfo: Any, dtype: torch.dtype) -> tuple[float, float]:
    """The OpInfo's own tolerance for compiled comparisons where it sets one, else ours for the dtype."""
    rtol, atol = _TOLERANCES.get(dtype, (0.0, 0.0))
    for decorate in getattr(opinfo, "decorators", ()):
        if getattr(decorate, "cls_name", None) not in ("TestInductorOpInfo", "TestDecomp"):
            continue
        for decorator in getattr(decorate, "decorators", ()):
            override = getattr(decorator, "d", None)
            if isinstance(override, dict) and dtype in override:
                tol = override[dtype]
                rtol, atol = max(rtol, tol.rtol), max(atol, tol.atol)
    return rtol, atol


def _leaf_pairs(actual: Any, expected: Any) -> tuple[str | None, list[tuple[Any, Any]]]:
    """(a reason when the two results differ in structure or in where tensors stand, the paired leaves)."""
    flat_a, spec_a = pytree.tree_flatten(actual)
    flat_e, spec_e = pytree.tree_flatten(expected)
    if spec_a != spec_e:
        return f"structure {spec_a} != {spec_e}", []
    for a, e in zip(flat_a, flat_e, strict=True):
        if isinstance(e, torch.Tensor) and not isinstance(a, torch.Tensor):
            return f"expected a tensor, got {type(a).__name__}", []
    return None, list(zip(flat_a, flat_e, strict=True))


def _close(actual: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """None when equal within tolerance, else a short reason."""
    reason, pairs = _leaf_pairs(actual, expected)
    if reason is not None:
        return reason
    for a, e in pairs:
        if isinstance(e, torch.Tensor):
            try:
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False,
                                           check_stride=False)
            except AssertionError as error:
                return str(error).strip().splitlines()[0][:300] + " " + " ".join(str(error).split())[-200:]
        elif a != e and not (isinstance(a, float) and isinstance(e, float) and a != a and e != e):
            return f"{a!r} != {e!r}"
    return None


def _same_layout(actual: Any, expected: Any) -> str | None:
    """None when ``actual`` has the structure, shapes and dtypes of ``expected``, else a short reason."""
    reason, pairs = _leaf_pairs(actual, expected)
    if reason is not None:
        return reason
    for a, e in pairs:
        if isinstance(e, torch.Tensor) and (a.shape != e.shape or a.dtype != e.dtype):
            return f"layout {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}"
    return None


def _to_float32(value: Any) -> Any:
    return pytree.tree_map(
        lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) else t,
        value,
    )


def _call(opinfo: Any, sample: Any, fn: Any = None) -> Any:
    fn = fn or opinfo.op
    return fn(sample.input, *sample.args, **sample.kwargs)


def _is_random(opinfo: Any, sample: Any) -> bool:
    torch.manual_seed(1)
    first = _call(opinfo, sample)
    torch.manual_seed(2)
    second = _call(opinfo, sample)
    return _close(first, second, 0.0, 0.0) is not None


def classify_error(error: BaseException) -> tuple[str, str]:
    chain = error
    while chain is not None:
        if isinstance(chain, UnsupportedOpError):
            return "unsupported", str(chain).splitlines()[0][:300]
        chain = chain.__cause__ or chain.__context__
    name = type(error).__name__
    text = " ".join(str(error).split())[:300]
    if isinstance(error, torch._dynamo.exc.BackendCompilerFailed):
        inner = error.inner_exception if hasattr(error, "inner_exception") else error
        if isinstance(inner, UnsupportedOpError):
            return "unsupported", str(inner).splitlines()[0][:300]
        return "crash", f"{type(inner).__name__}: {' '.join(str(inner).split())[:300]}"
    if isinstance(error, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                          torch._dynamo.exc.TorchRuntimeError)):
        return "dynamo", f"{name}: {text}"
    return "crash", f"{name}: {text}"


def _run_compiled(opinfo: Any, run: Any) -> tuple[Any, tuple[str, str] | None]:
    """``(run(the op compiled), None)``, or ``(None, (outcome, detail))`` when compiling or running it failed
    (classified, never re-raised: a sweep must survive every op) or compiled no graph."""
    torch._dynamo.reset()
    compiled = torch.compile(opinfo.op, backend="tpucompile", fullgraph=True, options={"fallback": "error"})
    before = driver.graphs_compiled()
    try:
        torch.manual_seed(0)
        actual = run(compiled)
    except Exception as error:
        return None, classify_error(error)
    if driver.graphs_compiled() == before:
        return None, ("no-graph", "")
    return actual, None


def run_sample(opinfo: Any, dtype: torch.dtype, sample: Any) -> tuple[str, str]:
    """Classify one sample; see the module docstring for the outcomes."""
    try:
        torch.manual_seed(0)
        expected = _call(opinfo, sample)
    except Exception:
        return "skip", "eager raised"
    undefined = opinfo.name in UNDEFINED_VALUES
    try:
        if not undefined and _is_random(opinfo, sample):
            return "random", ""
    except Exception:
        return "skip", "eager raised"
    actual, failed = _run_compiled(opinfo, lambda compiled: _call(opinfo, sample, compiled))
    if failed is not None:
        return failed
    if undefined:
        reason = _same_layout(actual, expected)
        return ("pass", "") if reason is None else ("mismatch", reason)
    rtol, atol = _tolerance(opinfo, dtype)
    reason = _close(actual, expected, rtol, atol)
    if reason is not None and dtype in (torch.bfloat16, torch.float16):
        try:
            reference = _to_float32(_call(opinfo, _sample_in_float32(sample)))
            if _close(_to_float32(actual), reference, rtol, atol) is None:
                reason = None
        except Exception:
            pass
    return ("pass", "") if reason is None else ("mismatch", reason)


def _gradients(opinfo: Any, sample: Any, fn: Any = None) -> tuple[Any, Any] | None:
    """(the outputs, the gradients of every sample tensor that requires grad) of a loss weighting each float
    output element differently; None when no output carries a gradient."""
    out = _call(opinfo, sample, fn)
    outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    leaves = [t for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs or not leaves:
        return None
    loss = sum((t * torch.linspace(-1.0, 2.0, t.numel(), dtype=t.dtype).reshape(t.shape)).sum() for t in outputs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), grads


def run_gradient_sample(opinfo: Any, dtype: torch.dtype, sample: Any) -> tuple[str, str]:
    """Classify one sample's forward and input gradients (the sample's tensors require grad)."""
    try:
        torch.manual_seed(0)
        expected = _gradients(opinfo, sample)
        if expected is None:
            return "skip", "no differentiable output"
        if _is_random(opinfo, sample):
            return "random", ""
    except Exception:
        return "skip", "eager raised"
    actual, failed = _run_compiled(opinfo, lambda compiled: _gradients(opinfo, sample, compiled))
    if failed is not None:
        return failed
    if actual is None:
        return "mismatch", "the compiled outputs carry no gradient"
    rtol, atol = _tolerance(opinfo, dtype)
    reason = _close(actual[0], expected[0], rtol, atol)
    if reason is None:
        reason = _close(actual[1], expected[1], rtol, atol)
        reason = None if reason is None else f"gradient: {reason}"
    return ("pass", "") if reason is None else ("mismatch", reason)


def _sample_in_float32(sample: Any) -> Any:
    return sample.transform(
        lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) else t
    )


def quiet_sweep_process() -> None:
    """What a sweep process sets for itself: no warnings or torch logs per sample, and its thousands of one-op
    graphs kept out of the user's persistent compile cache."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    os.environ.setdefault("TPUCOMPILE_CACHE_MODE", "off")


def select_opinfos(names: list[str] | None, shard: str | None) -> list[Any]:
    """The OpInfos named (name or name.variant; all when None), then only shard K of N ("K/N")."""
    opinfos = load_op_db()
    if names:
        wanted = set(names)
        opinfos = [o for o in opinfos if o.name in wanted or op_id(o) in wanted]
    if shard:
        index, count = (int(part) for part in shard.split("/"))
        opinfos = opinfos[index::count]
    return opinfos


def iter_samples(opinfo: Any, dtype: torch.dtype, max_samples: int | None, grad: bool = False
                 ) -> Iterator[tuple[int, Any]]:
    try:
        samples = opinfo.sample_inputs("cpu", dtype, requires_grad=grad)
        for index, sample in enumerate(samples):
            if max_samples is not None and index >= max_samples:
                return
            yield index, sample
    except Exception:
        return


def sweep(
    opinfos: Iterable[Any], dtypes: Iterable[torch.dtype], max_samples: int | None = None, progress: bool = False,
    grad: bool = False,
) -> list[SampleResult]:
    """Every sample's outcome; with ``grad``, of the OpInfos that support autograd, forward and input
    gradients (recorded under the dtype name with ``+grad``)."""
    results: list[SampleResult] = []
    for opinfo in opinfos:
        supported = opinfo.supported_dtypes("cpu")
        if grad and not opinfo.supports_autograd:
            continue
        for dtype in dtypes:
            if dtype not in supported or (grad and not dtype.is_floating_point):
                continue
            start = time.perf_counter()
            # OpInfo samples are drawn from torch's global generator: seed it per op and dtype so that every
            # run, shard and order sees the same inputs (the floor test depends on it).
            torch.manual_seed(zlib.crc32(f"{op_id(opinfo)}|{dtype}".encode()))
            for index, sample in iter_samples(opinfo, dtype, max_samples, grad):
                outcome, detail = (run_gradient_sample if grad else run_sample)(opinfo, dtype, sample)
                if outcome != "skip":
                    name = str(dtype).removeprefix("torch.") + ("+grad" if grad else "")
                    results.append(SampleResult(op_id(opinfo), name, index, outcome, detail))
            if progress:
                print(f"{op_id(opinfo):40s} {dtype}  {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return results


def summarize(results: list[SampleResult]) -> dict[str, Any]:
    """Totals per dtype and, per op and dtype, the outcome counts."""
    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    per_op: dict[str, dict[str, collections.Counter]] = collections.defaultdict(
        lambda: collections.defaultdict(collections.Counter)
    )
    for r in results:
        totals[r.dtype][r.outcome] += 1
        per_op[r.op][r.dtype][r.outcome] += 1
    return {"totals": totals, "per_op": per_op}


def pass_rate(counter: collections.Counter) -> float:
    counted = sum(counter[o] for o in COUNTED)
    return counter["pass"] / counted if counted else 0.0


def write_markdown(results: list[SampleResult], path: str, command: str) -> None:
    summary = summarize(results)
    dtypes = sorted(summary["totals"], key=lambda d: (list(DTYPES).index(d.split("+")[0])
                                                      if d.split("+")[0] in DTYPES else 99, d))
    lines = [
        "# ATen coverage: PyTorch's OpInfo suite through tpucompile",
        "",
        f"Generated by `{command}` with torch {torch.__version__}.",
        "Each OpInfo sample is compiled with `backend=\"tpucompile\", fullgraph=True` and compared with eager.",
        "The pass rate counts samples whose op Dynamo captured (pass + mismatch + unsupported + crash).",
        "",
        "| dtype | " + " | ".join(OUTCOMES) + " | pass rate |",
        "|---|" + "---|" * (len(OUTCOMES) + 1),
    ]
    for dtype in dtypes:
        counter = summary["totals"][dtype]
        lines.append(f"| {dtype} | " + " | ".join(str(counter[o]) for o in OUTCOMES)
                     + f" | {100 * pass_rate(counter):.1f}% |")
    lines += ["", "## Per op", "", "Cells: passed/counted samples, then the other outcomes.", "",
              "| op | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    for op in sorted(summary["per_op"]):
        cells = []
        for dtype in dtypes:
            counter = summary["per_op"][op].get(dtype)
            if not counter:
                cells.append("")
                continue
            counted = sum(counter[o] for o in COUNTED)
            extra = ", ".join(f"{o} {counter[o]}" for o in OUTCOMES[1:] if counter[o])
            cells.append(f"{counter['pass']}/{counted}" + (f" ({extra})" if extra else ""))
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    failures = [r for r in results if r.outcome in ("mismatch", "unsupported", "crash")]
    lines += ["", "## Failing samples", "", "| op | dtype | sample | outcome | detail |", "|---|---|---|---|---|"]
    for r in failures:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| {r.op} | {r.dtype} | {r.index} | {r.outcome} | {detail} |")
    kept = _kept_section(path)
    if kept:  # after the totals table
        at = lines.index("## Per op")
        lines[at:at] = [kept, ""]
    with open(path, "w") as out:
        out.write("\n".join(lines) + "\n")


KEPT_BEGIN, KEPT_END = "<!-- kept: modules and gradients -->", "<!-- /kept -->"


def _kept_section(path: str) -> str:
    """The block of the existing report between ``KEPT_BEGIN`` and ``KEPT_END`` (the ModuleInfo and gradient
    figures, written from other sweeps), which regenerating the OpInfo report keeps."""
    try:
        with open(path) as source:
            text = source.read()
    except OSError:
        return ""
    start, end = text.find(KEPT_BEGIN), text.find(KEPT_END)
    return text[start:end + len(KEPT_END)] if 0 <= start < end else ""


def run_in_processes(argv: list[str], jobs: int, env: dict[str, str] | None = None, timeout: float | None = None,
                     capture: bool = False) -> list[SampleResult]:
    """Run the same sweep as ``jobs`` fresh processes (in ``env``; this one's when None) over disjoint shards of
    the OpInfos, and merge their results. With ``capture`` their output is kept, and a failing shard's is in
    the error it raises; shards still running when one fails or ``timeout`` (for them all) passes are stopped."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        children = []
        for shard in range(jobs):
            out = os.path.join(folder, f"shard{shard}.json")
            log = stack.enter_context(open(os.path.join(folder, f"shard{shard}.log"), "w+")) if capture else None
            command = [sys.executable, os.path.abspath(__file__), *argv, "--jobs", "1",
                       "--shard", f"{shard}/{jobs}", "--json", out, "--quiet"]
            child = stack.enter_context(subprocess.Popen(command, env=env, stdout=log, stderr=log))
            stack.callback(lambda child=child: child.poll() is None and child.kill())
            children.append((child, out, log))
        results = []
        for child, out, log in children:
            code = child.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if code != 0:
                output = ""
                if log is not None:
                    log.seek(0)
                    output = ":\n" + log.read()[-3000:]
                raise SystemExit(f"a sweep shard failed with exit code {code}{output}")
            results += _read_json(out)
    return results


def write_json(results: list[SampleResult], path: str | os.PathLike) -> None:
    """Every sample's outcome as ``--json`` writes it (``_read_json`` reads it back)."""
    with open(path, "w") as out:
        json.dump([dataclasses.asdict(r) for r in results], out, indent=0)


def _read_json(path: str) -> list[SampleResult]:
    with open(path) as source:
        return [SampleResult(**record) for record in json.load(source)]


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without the given single-value options (so shards get their own)."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in options:
            skip = True
        elif not any(item.startswith(o + "=") for o in options):
            kept.append(item)
    return kept


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root not in sys.path:  # run as a script: ``tests`` importable as in the test session
        sys.path.insert(0, root)
    from tests.dynamo_settings import skip_guard_latency_profiling

    skip_guard_latency_profiling()
    parser = argparse.ArgumentParser(description="OpInfo sweep through backend='tpucompile'")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=list(DTYPES))
    parser.add_argument("--ops", nargs="*", help="OpInfo names (name or name.variant) to run; default all")
    parser.add_argument("--max-samples", type=int, default=None, help="samples per op and dtype")
    parser.add_argument("--json", help="write every sample's outcome here")
    parser.add_argument("--markdown", help="write the coverage report here (docs/coverage.md)")
    parser.add_argument("--jobs", type=int, default=1, help="processes to spread the OpInfos over")
    parser.add_argument("--shard", help="K/N: run only the OpInfos whose index is K modulo N")
    parser.add_argument("--merge", nargs="+", help="report on these --json files instead of running a sweep")
    parser.add_argument("--grad", action="store_true", help="compare input gradients too (autograd OpInfos)")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    quiet_sweep_process()
    if args.merge:
        results = [r for path in args.merge for r in _read_json(path)]
    elif args.jobs > 1:
        results = run_in_processes(_without(argv, ("--jobs", "--json", "--markdown")), args.jobs)
    else:
        opinfos = select_opinfos(args.ops, args.shard)
        gc.collect()
        gc.freeze()  # torch, jax and the OpInfo database, out of every full collection the samples' traces cause
        results = sweep(opinfos, [DTYPES[d] for d in args.dtypes], args.max_samples, args.progress, args.grad)
    summary = summarize(results)
    if not args.quiet:
        for dtype, counter in summary["totals"].items():
            print(f"{dtype}: " + ", ".join(f"{o} {counter[o]}" for o in OUTCOMES)
                  + f"; pass rate {100 * pass_rate(counter):.1f}%")
    if args.json:
        write_json(results, args.json)
    if args.markdown:
        command = "python tests/opinfo/sweep.py " + " ".join(_without(argv, ("--markdown",)))
        write_markdown(results, args.markdown, command.strip() + " --markdown " + args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
