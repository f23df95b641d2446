"""OpInfo samples with a dynamic dimension through bucketed executables (``dynamic_mode="bucket"``).

    python tests/opinfo/buckets.py --dims 0 -1 --json buckets.json

For each sample whose input has at least 4 elements along the chosen dimension (0 or the last), three sizes of
that dimension (n, n - 1, n - 2: one bucket) are made by narrowing every tensor of the sample that has size n
there, the dimension is marked dynamic, and each size runs eagerly and through one compiled function.
Outcomes:

* ``bucketed``   — one executable served all three sizes, and every result matched eager;
* ``per-size``   — tpucompile found an op padding would make inexact, warned, compiled per size; all matched;
* ``static``     — Dynamo specialised the sizes (nothing symbolic reached tpucompile); all matched;
* ``mismatch``   — some size's result differed from eager (the outcome that must never happen);
* ``unsupported``, ``crash``, ``dynamo`` — as in ``sweep.py``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import warnings
import zlib
from typing import Any

import torch

from tests.opinfo import sweep
from tpucompile.errors import TpuCompileWarning
from tpucompile.metrics import compile_stats as stats

OUTCOMES = ("bucketed", "per-size", "static", "mismatch", "unsupported", "crash", "dynamo", "random")


@dataclasses.dataclass
class BucketResult:
    op: str
    dim: int
    index: int
    outcome: str
    detail: str = ""


def _narrowed(sample: Any, dim: int, size: int, length: int) -> Any:
    """``sample`` with every tensor whose ``dim`` has ``size`` elements cut to ``length`` there (copies, so
    each can be marked dynamic)."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[dim] == size:
            narrowed = value.narrow(dim, 0, length).clone()
            torch._dynamo.mark_dynamic(narrowed, dim % value.dim())
            return narrowed
        return value

    return sample.transform(cut)


def run_sample(opinfo: Any, dtype: torch.dtype, sample: Any, dim: int) -> tuple[str, str] | None:
    """The outcome of one sample at three sizes of ``dim``; None when the sample has no such dimension."""
    if (not isinstance(sample.input, torch.Tensor) or sample.input.layout != torch.strided
            or sample.input.dim() == 0 or sample.input.shape[dim] < 4):
        return None
    size = sample.input.shape[dim]
    try:
        variants = [_narrowed(sample, dim, size, length) for length in (size, size - 1, size - 2)]
    except Exception:  # a tensor that cannot be narrowed (sparse, nested): not a sample for this sweep
        return None
    expected = []
    for variant in variants:
        try:
            torch.manual_seed(0)
            expected.append(sweep._call(opinfo, variant))
            if sweep._is_random(opinfo, variant):
                return "random", ""
        except Exception:
            return None
    torch._dynamo.reset()
    stats.reset()
    compiled = torch.compile(opinfo.op, backend="tpucompile", fullgraph=True,
                             options={"fallback": "error", "dynamic_mode": "bucket"})
    rtol, atol = sweep._tolerance(opinfo, dtype)
    per_size = ""
    for variant, want in zip(variants, expected, strict=True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TpuCompileWarning)
            try:
                torch.manual_seed(0)
                got = sweep._call(opinfo, variant, compiled)
            except Exception as error:
                if "ConstraintViolation" in type(error).__name__:  # Dynamo specialised the marked size
                    return "dynamo", str(error).splitlines()[0][:300]
                return sweep.classify_error(error)
        per_size = per_size or next((str(w.message) for w in caught if "once per size" in str(w.message)), "")
        if opinfo.name in sweep.UNDEFINED_VALUES:
            reason = sweep._same_layout(got, want)
        else:
            reason = sweep._close(got, want, rtol, atol)
        if reason is not None:
            return "mismatch", f"size {variant.input.shape[dim]}: {reason}"
    if per_size:
        return "per-size", per_size[:300]
    if stats.snapshot()["total"]["bucket_hits"]:
        return "bucketed", ""
    return "static", ""


def run(opinfos: list[Any], dims: list[int], dtype: torch.dtype, max_samples: int) -> list[BucketResult]:
    results = []
    for opinfo in opinfos:
        if dtype not in opinfo.supported_dtypes("cpu"):
            continue
        for dim in dims:
            torch.manual_seed(zlib.crc32(f"{sweep.op_id(opinfo)}|{dtype}|{dim}".encode()))
            for index, sample in sweep.iter_samples(opinfo, dtype, max_samples):
                found = run_sample(opinfo, dtype, sample, dim)
                if found is not None:
                    results.append(BucketResult(sweep.op_id(opinfo), dim, index, *found))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="OpInfo samples with a dynamic dimension, bucketed")
    parser.add_argument("--dims", nargs="+", type=int, default=[0, -1])
    parser.add_argument("--ops", nargs="*", help="OpInfo names to run; default all")
    parser.add_argument("--max-samples", type=int, default=1)
    parser.add_argument("--shard", help="K/N: only the OpInfos whose index is K modulo N")
    parser.add_argument("--json", help="write every sample's outcome here")
    args = parser.parse_args(argv)
    sweep.quiet_sweep_process()
    results = run(sweep.select_opinfos(args.ops, args.shard), args.dims, torch.float32, args.max_samples)
    counts = collections.Counter(r.outcome for r in results)
    print(", ".join(f"{o} {counts[o]}" for o in OUTCOMES))
    for r in results:
        if r.outcome in ("mismatch", "crash"):
            print(f"{r.outcome}: {r.op} dim {r.dim} sample {r.index}: {r.detail[:240]}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump([dataclasses.asdict(r) for r in results], out, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
