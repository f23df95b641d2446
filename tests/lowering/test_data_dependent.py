"""Ops with data-dependent result sizes (nonzero, masked_select, unique, unique_consecutive) against eager.

They compile to programs with padded results plus the actual size, as regions of their own; the runtime cuts
the padding. conftest sets ``fallback="error"``, so none of this can pass by running the op in eager PyTorch.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.support import assert_compiles_like_eager, compile_fn
from tpucompile import driver

aten = torch.ops.aten
NAN = float("nan")


def test_nonzero_argwhere_and_masked_select(aten_ops):
    x = torch.randn(4, 6)
    x[1] = 0.0

    def fn(x):
        return torch.nonzero(x > 0.3), torch.argwhere(x), torch.masked_select(x, x < -0.2)

    assert_compiles_like_eager(fn, x)
    assert {aten.nonzero.default, aten.masked_select.default} <= aten_ops


def test_nonzero_of_scalar_bool_and_empty_inputs():
    def fn(s, b, e):
        return torch.nonzero(s), torch.nonzero(b), torch.nonzero(e), torch.masked_select(e, e > 0)

    assert_compiles_like_eager(fn, torch.tensor(2.0), torch.tensor([[True, False], [True, True]]), torch.zeros(3, 0))


def test_masked_select_broadcasts_the_mask_over_the_input():
    # (PyTorch's traced graph asserts that the result is no larger than the input, so broadcasting the input
    # over a larger mask fails under torch.compile with any backend.)
    x = torch.randn(3, 4, 5)
    mask = torch.rand(4, 1) > 0.5
    assert_compiles_like_eager(lambda x, m: torch.masked_select(x, m), x, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_unique_flat_with_inverse_and_counts(aten_ops, dtype):
    x = torch.randint(-3, 4, (5, 7)).to(dtype)

    def fn(x):
        return torch.unique(x, return_inverse=True, return_counts=True), torch.unique(x, sorted=False)

    assert_compiles_like_eager(fn, x)
    assert aten._unique2.default in aten_ops


def test_unique_counts_every_nan_once_and_sorts_it_last():
    x = torch.tensor([2.0, NAN, -0.0, 1.0, NAN, 0.0, 2.0])
    assert_compiles_like_eager(lambda x: torch.unique(x, return_inverse=True, return_counts=True), x)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_unique_rows_along_a_dim(aten_ops, dim):
    x = torch.randint(0, 2, (6, 3, 4)).float()
    x[3] = x[0]

    def fn(x):
        return torch.unique(x, dim=dim, return_inverse=True, return_counts=True)

    assert_compiles_like_eager(fn, x)
    assert aten.unique_dim.default in aten_ops


@pytest.mark.parametrize("dim", [None, 0, -1])
def test_unique_consecutive(aten_ops, dim):
    x = torch.tensor([[1, 1, 2], [1, 1, 2], [3, 3, 3], [1, 1, 2]]).float()

    def fn(x):
        return torch.unique_consecutive(x, return_inverse=True, return_counts=True, dim=dim)

    assert_compiles_like_eager(fn, x)
    assert aten.unique_consecutive.default in aten_ops


def test_data_dependent_size_flows_into_compiled_code_after_it():
    def fn(x, y):
        picked = torch.masked_select(x, x > 0)
        rows = torch.nonzero(y > 0.5)[:, 0]
        return picked.sum() * 2 + picked.numel(), torch.index_select(y, 0, rows).cos(), torch.unique(rows)

    x, y = torch.randn(5, 4), torch.rand(6, 3)
    compiled = compile_fn(fn)
    for _ in range(3):  # new data, new sizes: the regions after the op get compiled for each size seen
        for a, e in zip(compiled(x, y), fn(x, y), strict=True):
            torch.testing.assert_close(a, e)
        x, y = torch.randn(5, 4), torch.rand(6, 3)


def test_gradient_through_masked_select():
    x = torch.randn(4, 5, requires_grad=True)
    mask = torch.rand(4, 5) > 0.4
    assert_compiles_like_eager(lambda x, m: (torch.masked_select(x, m) ** 2).sum(), x, mask, grad=True)


def test_data_dependent_ops_are_compiled_not_run_eagerly(caplog):
    compiled = compile_fn(lambda x: torch.nonzero(x).float().mean(), fallback="error")
    before = driver.recent_executables()  # held, so no new executable can take an old one's id
    with caplog.at_level(logging.WARNING, logger="tpucompile"):
        result = compiled(torch.tensor([0.0, 1.0, 0.0, 3.0]))
    assert result.item() == pytest.approx(2.0)
    # the padded nonzero and the mean after it (new ones by identity: the record keeps the last 64, so a count
    # stops growing once the session has made that many)
    assert len([e for e in driver.recent_executables() if all(e is not old for old in before)]) >= 2


@pytest.mark.parametrize("fn", [
    lambda x: (torch.nonzero(x > 0.3), torch.argwhere(x), torch.masked_select(x, x < -0.2)),
    lambda x: torch.unique(x.round(), return_inverse=True, return_counts=True),
    lambda x: torch.unique_consecutive(x.round(), return_inverse=True, return_counts=True, dim=0),
], ids=["nonzero-masked-select", "unique", "unique-consecutive"])
def test_data_dependent_sizes_under_buckets(fn):
    """With ``dynamic_mode="bucket"``, a region that takes a value of data-dependent size (a ``nonzero``'s rows)
    is bucketed over that size, and Dynamo's assertion on it (``u1 <= 24``) depends on the call: it is checked
    on each call's sizes, not decided at the bucket's (where it failed: 32 rows are more than 24)."""
    x = torch.randn(4, 6)
    x[1] = 0.0
    assert_compiles_like_eager(fn, x, dynamic_mode="bucket")
