"""Shared checks: run a function eagerly and through ``backend="tpucompile"`` and compare; and the random
inputs several test files draw, defined once so that they draw the same values.

Every comparison resets Dynamo first and compiles with ``fullgraph=True``, and checks that tpucompile
really compiled a graph, so that a silent fallback to eager can never make a test pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from tpucompile import driver

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1.3e-6 * 10),
    torch.float64: dict(atol=1e-7, rtol=1e-7),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.complex64: dict(atol=1e-5, rtol=1.3e-6 * 10),
    torch.complex128: dict(atol=1e-7, rtol=1e-7),
}


def compile_fn(fn: Callable, **options: Any) -> Callable:
    torch._dynamo.reset()
    return torch.compile(fn, backend="tpucompile", fullgraph=True, options=options or None)


def compiles_per_setting(fn: Callable, args: Sequence[Any], option: str, settings: Sequence[Any],
                         cache_dir: str) -> list[int]:
    """How many graphs each call of ``fn(*args)`` compiled, one call per setting of ``option`` in turn, all
    sharing the persistent cache in ``cache_dir`` (Dynamo reset before each, so only that cache can serve)."""
    import tpucompile

    counts = []
    for setting in settings:
        torch._dynamo.reset()
        before = tpucompile.stats()["total"]["compiles"]
        compile_fn(fn, **{option: setting, "cache_dir": cache_dir})(*args)
        counts.append(tpucompile.stats()["total"]["compiles"] - before)
    return counts


def assert_close_tree(actual: Any, expected: Any, atol: float | None = None, rtol: float | None = None) -> None:
    flat_actual, spec_actual = pytree.tree_flatten(actual)
    flat_expected, spec_expected = pytree.tree_flatten(expected)
    assert spec_actual == spec_expected, f"output structure {spec_actual} != {spec_expected}"
    for a, e in zip(flat_actual, flat_expected, strict=True):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"expected a tensor, got {type(a)}"
            assert a.dtype == e.dtype, f"dtype {a.dtype} != {e.dtype}"
            assert a.shape == e.shape, f"shape {tuple(a.shape)} != {tuple(e.shape)}"
            tol = {} if atol is None else dict(atol=atol, rtol=rtol if rtol is not None else 0)
            if not tol and e.dtype in TOLERANCES:
                tol = TOLERANCES[e.dtype]
            torch.testing.assert_close(a, e, equal_nan=True, **tol)
        else:
            assert a == e, f"{a!r} != {e!r}"


def assert_compiles_like_eager(
    fn: Callable,
    *inputs: Any,
    atol: float | None = None,
    rtol: float | None = None,
    grad: bool = False,
    **options: Any,
) -> Any:
    """Compare ``fn(*inputs)`` eagerly and compiled; with ``grad`` also compare input gradients.

    Returns the compiled result.
    """
    eager_inputs = _clone_inputs(inputs, grad)
    compiled_inputs = _clone_inputs(inputs, grad)
    expected = fn(*eager_inputs)
    before = driver.graphs_compiled()
    actual = compile_fn(fn, **options)(*compiled_inputs)
    assert driver.graphs_compiled() > before, "tpucompile compiled no graph (did Dynamo fall back?)"
    assert_close_tree(actual, expected, atol, rtol)
    if grad:
        _backward(expected)
        _backward(actual)
        for e, a in zip(eager_inputs, compiled_inputs, strict=True):
            if isinstance(e, torch.Tensor) and e.requires_grad:
                assert a.grad is not None, "compiled run produced no gradient"
                assert_close_tree(a.grad, e.grad, atol, rtol)
    return actual


def _clone_inputs(inputs: Sequence[Any], grad: bool) -> list[Any]:
    cloned = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
            if grad and (value.is_floating_point() or value.is_complex()):
                value.requires_grad_(True)
        cloned.append(value)
    return cloned


def _as_real(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 view of an output for a real loss: a complex one as its (real, imaginary) pairs."""
    return torch.view_as_real(tensor.resolve_conj()).float() if tensor.is_complex() else tensor.float()


def _backward(output: Any) -> None:
    tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    total = sum((_as_real(t) * torch.linspace(0.5, 1.5, _as_real(t).numel()).reshape(_as_real(t).shape)).sum()
                for t in tensors)
    total.backward()


# ----------------------------------------------------------------------------------------------------------
# Random inputs (from torch's global generator: seed it, e.g. with the ``seeded`` fixture)

EDGE_VALUES = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0)
"""Where float ops have their special cases: NaN, ±inf, ±0, ±1."""
TIE_VALUES = (*EDGE_VALUES, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5)
"""``EDGE_VALUES`` and the halves at which rounding ops break ties."""


def _randn_with(values: Sequence[float], dtype: torch.dtype, shape: Sequence[int], scale: float,
                specials: bool) -> torch.Tensor:
    x = torch.randn(*shape) * scale
    if specials:
        x.view(-1)[: len(values)] = torch.tensor(values)
    return x.to(dtype)


def floats(dtype: torch.dtype, *shape: int, scale: float = 4.0, specials: bool = True) -> torch.Tensor:
    """Random floats with both signs (normal, standard deviation ``scale``); with ``specials`` the first
    elements are ``EDGE_VALUES``."""
    return _randn_with(EDGE_VALUES, dtype, shape, scale, specials)


def floats_with_ties(dtype: torch.dtype, *shape: int, scale: float = 2.0, specials: bool = True) -> torch.Tensor:
    """Random floats with both signs (normal, standard deviation ``scale``); with ``specials`` the first
    elements are ``TIE_VALUES``, for ops (unary math, rounding) whose edge cases include the halves."""
    return _randn_with(TIE_VALUES, dtype, shape, scale, specials)


def ints(dtype: torch.dtype, *shape: int, low: int = -20, high: int = 20, nonzero: bool = False) -> torch.Tensor:
    """Random integers in ``[low, high)``; with ``nonzero`` zeros become ones (divisors)."""
    x = torch.randint(low, high, shape, dtype=dtype)
    if nonzero:
        x = torch.where(x == 0, torch.ones_like(x), x)
    return x


def small_ints(dtype: torch.dtype, *shape: int, low: int = -5, high: int = 6) -> torch.Tensor:
    """Random integers in ``[low, high)``, by default a range small enough for sums and products of a few
    of them not to overflow, and for ties to happen."""
    return torch.randint(low, high, shape, dtype=dtype)


def crossed_padded(monkeypatch: Any) -> list[bool]:
    """Per runtime-sized argument of each bucketed call from now on, whether it crossed as the padded buffer a
    result was cut from (``runtime/padded_results``) rather than padded anew."""
    from tpucompile.runtime.buckets import BucketedGraph

    seen = []
    original = BucketedGraph._padded_result

    def spy(tensor: Any, shape: tuple[int, ...], take: bool) -> Any:
        found = original(tensor, shape, take)
        seen.append(found is not None)
        return found

    monkeypatch.setattr(BucketedGraph, "_padded_result", staticmethod(spy))
    return seen
