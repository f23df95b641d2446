"""Whole models against eager: inference, and training steps comparing losses, gradients and parameters."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.support import assert_close_tree

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

from mingpt import GPT, GPTConfig  # noqa: E402
from mlp import make_mlp  # noqa: E402


def _train_side_by_side(eager: nn.Module, make_batch, steps: int = 3, tol: float = 1e-4, lr: float = 0.1):
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    # SGD, not Adam: Adam rescales a gradient that is zero up to rounding (e.g. a bias before BatchNorm) to a
    # full step of either sign, which would compare rounding noise instead of the compiler.
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in (eager, model)]
    for _ in range(steps):
        inputs, loss_fn = make_batch()
        losses = []
        for net, optimizer in zip((eager, compiled), optimizers, strict=True):
            optimizer.zero_grad()
            loss = loss_fn(net, *inputs)
            loss.backward()
            losses.append(loss)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
        for optimizer in optimizers:
            optimizer.step()
        torch.testing.assert_close(losses[1], losses[0], atol=tol, rtol=tol)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol)
    for b, c in zip(model.buffers(), eager.buffers(), strict=True):
        assert_close_tree(b, c, atol=tol, rtol=tol)


def test_mlp_training():
    torch.manual_seed(0)
    net = make_mlp(width=32, depth=3, classes=5)

    def batch():
        x, y = torch.randn(16, 32), torch.randint(0, 5, (16,))
        return (x, y), lambda m, x, y: F.cross_entropy(m(x), y)

    _train_side_by_side(net, batch)


def test_gpt_inference_and_training():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    net = GPT(config)
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        compiled = torch.compile(copy.deepcopy(net), backend="tpucompile")
        torch.testing.assert_close(compiled(idx), net(idx), atol=1e-4, rtol=1e-4)

    def batch():
        idx, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
        return (idx, targets), lambda m, i, t: m(i, t)

    _train_side_by_side(net, batch)


class _ConvBatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def test_batchnorm_model_training_updates_running_stats():
    torch.manual_seed(0)

    def batch():
        x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
        return (x, y), lambda m, x, y: F.cross_entropy(m(x), y)

    _train_side_by_side(_ConvBatchNormNet(), batch)


@pytest.mark.parametrize("script", ["mlp.py", "mingpt.py"])
def test_examples_run(script):
    """The README's main job as a user runs it: every setting at its default (the session turns the host
    kernels off and compiles CPU programs at LLVM's level 0; here "auto" times the host kernels and keeps the
    ones that win, and XLA compiles at its own level)."""
    environ = {**os.environ, "TPUCOMPILE_HOST_KERNELS": "auto"}
    environ.pop("TPUCOMPILE_XLA_CPU_OPTIMIZATION_LEVEL", None)
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, script)], capture_output=True, text=True,
                            timeout=600, env=environ)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "step 2:" in result.stdout
