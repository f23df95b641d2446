"""PyTorch's foreach OpInfos (``foreach_*_op_db``: every ``torch._foreach_*`` op with its samples of list,
scalar, scalar-list and tensor arguments), compiled with eager fallback refused and compared with eager:
one graph per OpInfo holding all of its float32 samples, out of place and in place."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support import assert_close_tree, compile_fn
from tpucompile import driver


def _foreach_op_db() -> list:
    from torch.testing._internal import common_methods_invocations as ops

    return (ops.foreach_unary_op_db + ops.foreach_binary_op_db + ops.foreach_pointwise_op_db
            + ops.foreach_reduce_op_db + ops.foreach_other_op_db)


OP_DB = {op.name: op for op in _foreach_op_db()}
DYNAMO_SKIPS = {"_foreach_max", "_foreach_mm"}
"""Ops Dynamo does not trace (it marks these builtins as skipped, so they run eagerly outside any graph)."""


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


def _calls(op, samples) -> list:
    """(variant, sample) pairs eager PyTorch accepts: it refuses some samples (a bool scalar subtracted, a
    float result written into an integer list in place), which are left out, as errors are not compared."""
    calls = []
    for sample in samples:
        for variant in (op.op, op.inplace_variant):
            if variant is None:
                continue
            try:
                variant(_cloned(sample.input), *_cloned(sample.args), **sample.kwargs)
            except RuntimeError:
                continue
            calls.append((variant, sample))
    return calls


def _run_all(calls):
    def run(inputs):
        results = []
        for (variant, sample), (tensors, args) in zip(calls, inputs, strict=True):
            out = variant(tensors, *args, **sample.kwargs)
            results.append(tensors if out is None else out)  # an in-place variant's result is its list
        return results

    return run


@pytest.mark.parametrize("name", sorted(DYNAMO_SKIPS))
def test_dynamo_still_skips(name):
    """Once Dynamo traces one of these, it belongs in the test below."""
    sample = next(iter(OP_DB[name].sample_inputs("cpu", torch.float32, num_input_tensors=[2])))
    with pytest.raises(torch._dynamo.exc.Unsupported, match="skipped"):
        compile_fn(lambda tensors, *args: OP_DB[name].op(tensors, *args, **sample.kwargs))(
            sample.input, *sample.args)


@pytest.mark.parametrize("name", sorted(set(OP_DB) - DYNAMO_SKIPS))
def test_foreach_opinfo_compiles_whole_like_eager(name):
    warnings.filterwarnings("ignore")
    op = OP_DB[name]
    torch.manual_seed(0)
    samples = list(op.sample_inputs("cpu", torch.float32, num_input_tensors=[3]))
    assert samples, name
    calls = _calls(op, samples)
    inputs = [(sample.input, list(sample.args)) for _, sample in calls]
    run = _run_all(calls)
    expected = run(_cloned(inputs))
    before = driver.graphs_compiled()
    actual = compile_fn(run, fallback="error")(_cloned(inputs))
    assert driver.graphs_compiled() > before, f"{name}: nothing compiled"
    assert_close_tree(actual, expected)
