"""Random ops: right shapes and dtypes, right distributions, reproducible under torch.manual_seed, and a
fresh stream on every call. Compiled randomness matches eager statistically, not bitwise."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.support import compile_fn

N = 200_000


def _sigma(variance: float) -> float:
    """Tolerance for a sample mean: six standard errors (fails by chance about once in 10^9 runs)."""
    return 6 * math.sqrt(variance / N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rand_is_uniform_on_half_open_interval(dtype):
    x = compile_fn(lambda: torch.rand(N, dtype=dtype))()
    assert x.dtype == dtype and x.shape == (N,)
    assert float(x.min()) >= 0.0 and float(x.max()) < 1.0
    x = x.double()
    assert abs(x.mean().item() - 0.5) < _sigma(1 / 12) + (4e-3 if dtype is torch.bfloat16 else 0)
    assert abs(x.var().item() - 1 / 12) < 2e-3
    histogram = torch.histc(x, bins=10, min=0, max=1) / N
    assert (histogram - 0.1).abs().max() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_randn_is_standard_normal(dtype):
    x = compile_fn(lambda: torch.randn(N, dtype=dtype))().double()
    assert abs(x.mean().item()) < _sigma(1.0)
    assert abs(x.std().item() - 1.0) < 0.01
    # Tail mass beyond 2 sigma: 4.55% for a normal.
    assert abs((x.abs() > 2).double().mean().item() - 0.0455) < 0.003
    assert torch.isfinite(x).all()


def test_randint_range_and_uniformity():
    x = compile_fn(lambda: torch.randint(-3, 7, (N,)))()
    assert x.dtype == torch.int64
    assert int(x.min()) == -3 and int(x.max()) == 6
    counts = torch.bincount(x + 3, minlength=10).double() / N
    assert (counts - 0.1).abs().max() < 0.01


def test_bernoulli_and_rand_like():
    def draw(p):
        return torch.bernoulli(p), torch.rand_like(p), torch.randn_like(p)

    p = torch.full((N,), 0.3)
    hits, u, z = compile_fn(draw)(p)
    assert hits.dtype == torch.float32 and set(hits.unique().tolist()) <= {0.0, 1.0}
    assert abs(hits.mean().item() - 0.3) < _sigma(0.21)
    assert abs(u.mean().item() - 0.5) < _sigma(1 / 12)
    assert abs(z.mean().item()) < _sigma(1.0)
    assert abs(torch.corrcoef(torch.stack([u, z]))[0, 1].item()) < 0.02  # independent streams


def test_dropout_in_training_keeps_expectation_and_gradient_uses_the_same_mask():
    x = torch.ones(N, requires_grad=True)
    y = compile_fn(lambda x: F.dropout(x, p=0.25, training=True))(x)
    kept = y != 0
    assert abs(kept.double().mean().item() - 0.75) < _sigma(0.1875)
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.75))
    y.sum().backward()
    torch.testing.assert_close(x.grad, kept.float() / 0.75)


def test_reproducible_under_manual_seed_and_fresh_on_each_call():
    f = compile_fn(lambda x: x + torch.rand_like(x))
    x = torch.zeros(1000)
    torch.manual_seed(123)
    first, second = f(x), f(x)
    assert not torch.equal(first, second)
    torch.manual_seed(123)
    assert torch.equal(f(x), first)
    assert torch.equal(f(x), second)


def test_explicit_generator_is_refused_or_left_to_eager():
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(Exception, match=r"[Gg]enerator"):
        compile_fn(lambda x: x + torch.rand(x.shape, generator=generator))(torch.zeros(3))
