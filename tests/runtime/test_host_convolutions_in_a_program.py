"""A DenseNet-style training step with its convolutions on the host kernel: the whole program, not one
convolution alone, computes what eager PyTorch does, values and every gradient.

A reported gradient error of a compiled ``densenet121`` step (a few % of the largest gradient, gone with
``TPUCOMPILE_HOST_CONV=0``) was no kernel fault: ReLU and max pooling make such a step's gradient jump where a
pre-activation crosses zero, and one crossing at ~1e-6 of the activations' scale, within any f32 convolution's
rounding, moved 2% of the gradient. Eager itself moves as far against float64, against eager without oneDNN, with
another thread count, and so does Inductor. This program keeps the same structure (concatenated features fed to the
calls, a strided stem whose input gradient is a transposed convolution, kernel gradients summed over three images,
by as many workers as take them) with smooth activations and average pooling, so its gradient has no such jumps and
a fault of the call inside the program (operand layouts after a concatenation, buffer reuse with the scratch
result, a race between workers) would show as an error far above rounding.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.nn as nn

from tpucompile import driver
from tpucompile.runtime import optimized_hlo
from tpucompile.runtime.host_kernels.library import CONV_TARGET_NAME


class _DenseLayer(nn.Module):
    def __init__(self, channels: int, growth: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.BatchNorm2d(channels), nn.Conv2d(channels, 2 * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(2 * growth)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = self.conv1(nn.functional.silu(self.norm1(torch.cat(features, 1))))
        return self.conv2(nn.functional.silu(self.norm2(x)))


class _DenseNet(nn.Module):
    """Stem 7x7/2 conv, a dense block of three layers at 16x16, a transition, a classifier."""

    def __init__(self, stem: int = 8, growth: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.conv0, self.norm0 = nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem)
        self.block = nn.ModuleList(_DenseLayer(stem + i * growth, growth) for i in range(layers))
        channels = stem + layers * growth
        self.norm, self.conv = nn.BatchNorm2d(channels), nn.Conv2d(channels, channels // 2, 1, bias=False)
        self.classifier = nn.Linear(channels // 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [nn.functional.silu(self.norm0(self.conv0(x)))]
        for layer in self.block:
            features.append(layer(features))
        y = self.conv(nn.functional.silu(self.norm(torch.cat(features, 1))))
        y = nn.functional.avg_pool2d(y, 2)
        return self.classifier(y.mean((2, 3)))


def _step(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().clone().requires_grad_()
    out = model(x)
    nn.functional.cross_entropy(out, labels).backward()
    return out.detach(), [x.grad, *(p.grad for p in model.parameters())]


def test_dense_block_training_step_matches_eager(target):
    torch.manual_seed(0)
    eager = _DenseNet().train()
    x, labels = torch.randn(3, 3, 32, 32), torch.tensor([1, 7, 3])
    programs: list[str] = []
    remove = driver.add_observer(lambda event: programs.append(optimized_hlo(event.executable)))
    try:
        torch._dynamo.reset()
        compiled = copy.deepcopy(eager)
        step = torch.compile(compiled, backend="tpucompile", fullgraph=True, options={"host_kernels": "on"})
        got = _step(step, x, labels)
    finally:
        remove()
        torch._dynamo.reset()
    want = _step(eager, x, labels)

    # Every kernel mode ran inside the programs: forward, kernel gradient (three images, one product each,
    # summed by the workers that took them) and transposed (the stem's input gradient).
    marker = f'custom_call_target="{CONV_TARGET_NAME}"'
    calls = [line for hlo in programs for line in hlo.splitlines() if marker in line]
    modes = sorted({int(m) for line in calls for m in re.findall(r"\bmode = (\d+)", line)})
    assert modes == [0, 1, 2], f"{len(calls)} host convolution calls, modes {modes}"

    # Eager's own float32 results are up to 1e-5 of each tensor's largest element away from float64 here (the
    # BatchNorm weight gradients are sums that cancel), the compiled ones as far, XLA's convolutions or not;
    # a faulty call errs by a good part of the tensor.
    names = ["output", "input gradient", *(f"{n} gradient" for n, _ in eager.named_parameters())]
    for name, actual, expected in zip(names, [got[0], *got[1]], [want[0], *want[1]], strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4 * expected.abs().max().item(), msg=name)
