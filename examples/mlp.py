"""A multi-layer perceptron compiled with ``backend="tpucompile"``: inference and a few SGD steps,
checked against eager PyTorch.

    python examples/mlp.py
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


def make_mlp(width: int = 256, depth: int = 4, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.SiLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def main() -> None:
    torch.manual_seed(0)
    eager = make_mlp()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    x = torch.randn(64, 256)
    labels = torch.randint(0, 10, (64,))

    with torch.no_grad():
        diff = (compiled(x) - eager(x)).abs().max().item()
    print(f"inference: max |compiled - eager| = {diff:.2e}")
    assert diff < 1e-4, diff

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    for step in range(3):
        losses = []
        for net, optimizer in zip((eager, compiled), optimizers, strict=True):
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        print(f"step {step}: loss eager {losses[0]:.6f}  tpucompile {losses[1]:.6f}")
        assert abs(losses[0] - losses[1]) < 1e-4, losses


if __name__ == "__main__":
    main()
