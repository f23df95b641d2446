"""Weight normalisation (``w = g * v / ||v||``, the norm over every dim but ``dim``) trained through
``torch.compile``: the forward's ``aten._weight_norm_interface`` (decomposed by the table) and its backward
``aten._weight_norm_interface_backward`` (lowered whole), with both PyTorch APIs.

Gradients are compared with eager to 1e-5 of the largest gradient of the step, the float32 rounding of a
few reductions over the kernel (observed: under 3e-7).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from tests.support import assert_compiles_like_eager, compile_fn
from tpucompile import driver

aten = torch.ops.aten

WEIGHT_NORM_BACKWARD = aten._weight_norm_interface_backward.default


def _legacy_weight_norm(module: nn.Module, dim: int) -> nn.Module:
    """``torch.nn.utils.weight_norm``, deprecated but still what older checkpoints (wav2vec2's) use."""
    with pytest.warns(FutureWarning, match="weight_norm"):
        return torch.nn.utils.weight_norm(module, dim=dim)


APIS = {"parametrizations": parametrizations.weight_norm, "legacy": _legacy_weight_norm}

# (module, input shape, dim, whether the fused op and its backward are used: dim first or last)
MODULES = {
    # wav2vec2's positional convolution: weight norm over the kernel dim (the last of three), grouped
    "conv1d_dim2": (lambda: nn.Conv1d(8, 8, 5, padding=2, groups=2), (2, 8, 20), 2, True),
    "conv1d_dim0": (lambda: nn.Conv1d(6, 4, 3, padding=1), (2, 6, 9), 0, True),
    "conv1d_dim1": (lambda: nn.Conv1d(6, 4, 3), (2, 6, 9), 1, False),
    "linear_dim0": (lambda: nn.Linear(8, 6), (3, 8), 0, True),
}


def _train_step(model: Callable, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    (out * torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape)).square().sum().backward()
    return out.detach()


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", MODULES)
def test_weight_norm_training_step(aten_ops, api, case):
    make, shape, dim, fused = MODULES[case]
    torch.manual_seed(0)
    eager = APIS[api](make(), dim=dim)
    torch.manual_seed(0)
    compiled = APIS[api](make(), dim=dim)
    x = torch.randn(shape)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()

    expected = _train_step(eager, x_eager)
    before = driver.graphs_compiled()
    actual = _train_step(compile_fn(compiled, fallback="error"), x_compiled)
    assert driver.graphs_compiled() > before

    grads = {"input": (x_compiled.grad, x_eager.grad)}
    grads.update({name: (p.grad, e.grad) for (name, p), e in
                  zip(compiled.named_parameters(), eager.parameters(), strict=True)})
    scale = max(e.abs().max().item() for _, e in grads.values())
    torch.testing.assert_close(actual, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    for name, (got, want) in grads.items():
        assert got is not None, f"no gradient for {name}"
        torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert (WEIGHT_NORM_BACKWARD in aten_ops) == fused


@pytest.mark.parametrize(("shape", "dim"), [((5, 3, 4), 0), ((5, 3, 4), 2), ((2, 3, 2, 4), 3), ((7, 1), 0),
                                            ((7,), 0)])
def test_weight_norm_interface_float32(aten_ops, shape, dim):
    """The op pair on its own, with ``g`` of its keep-dim shape (one value per slice along ``dim``)."""
    v = torch.randn(shape)
    g = torch.randn([s if d == dim else 1 for d, s in enumerate(shape)])
    assert_compiles_like_eager(lambda v, g: torch._weight_norm(v, g, dim), v, g, grad=True, fallback="error")
    assert WEIGHT_NORM_BACKWARD in aten_ops


def test_weight_norm_interface_bfloat16(aten_ops):
    """bf16 ``v`` and ``g``: the norm is kept in f32 (as eager's kernel keeps it) and the backward computed in
    f32, each gradient rounded once to bf16."""
    torch.manual_seed(0)
    v, g = torch.randn(6, 4, 5).bfloat16(), torch.randn(6, 1, 1).bfloat16()
    assert_compiles_like_eager(lambda v, g: torch._weight_norm(v, g, 0), v, g, grad=True, fallback="error")
    assert WEIGHT_NORM_BACKWARD in aten_ops
