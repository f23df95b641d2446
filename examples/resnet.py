"""A small ResNet (basic blocks) compiled with ``backend="tpucompile"``: inference, then one SGD training
step in train mode (BatchNorm batch statistics and running-stat updates), each checked against the same model
run eagerly.

    python examples/resnet.py

Random initialisation and random images: nothing is downloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from measure import best_ms, max_diff


@dataclasses.dataclass
class ResNetConfig:
    in_channels: int = 3
    image_size: int = 32
    stem_width: int = 16
    stem_kernel: int = 3
    stem_stride: int = 1
    widths: tuple[int, ...] = (16, 32, 64)
    blocks_per_stage: int = 1
    num_classes: int = 10


RESNET_18 = ResNetConfig(image_size=64, stem_width=64, stem_kernel=7, stem_stride=2, widths=(64, 128, 256, 512),
                         blocks_per_stage=2)
"""ResNet-18's layout (a 7x7/2 stem, four stages of two basic blocks) on 64x64 images."""


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity shortcut, or a strided 1x1 conv+BN shortcut when the block
    changes resolution or width."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, config.stem_width, config.stem_kernel, stride=config.stem_stride,
                      padding=config.stem_kernel // 2, bias=False),
            nn.BatchNorm2d(config.stem_width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        channels = config.stem_width
        for index, width in enumerate(config.widths):
            for block in range(config.blocks_per_stage):
                stride = 2 if index > 0 and block == 0 else 1
                stages.append(BasicBlock(channels, width, stride))
                channels = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, config.num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def main() -> None:
    torch.manual_seed(0)
    config = ResNetConfig()
    eager = ResNet(config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    batch = 8
    images = torch.randn(batch, config.in_channels, config.image_size, config.image_size)
    labels = torch.randint(0, config.num_classes, (batch,))

    # Inference in eval mode: BatchNorm uses its running statistics.
    eager.eval()
    model.eval()
    with torch.no_grad():
        start = time.perf_counter()
        logits = compiled(images)
        first_call = time.perf_counter() - start
        reference = eager(images)
    diff = (logits - reference).abs().max().item()
    print(f"inference: logits {tuple(logits.shape)}, max |compiled - eager| = {diff:.2e} "
          f"(first call incl. compile {first_call:.2f}s)")
    assert diff < 1e-4, diff

    # One training step in train mode: batch statistics, running-stat updates, SGD with momentum.
    eager.train()
    model.train()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4) for m in (eager, model)]

    def train_step(net: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(net(images), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = []
    grads = []
    for net, optimizer in zip((eager, compiled), optimizers, strict=True):
        losses.append(train_step(net, optimizer))
        grads.append([p.grad.clone() for p in (eager if net is eager else model).parameters()])
    loss_diff = (losses[0] - losses[1]).abs().item()
    print(f"train step: loss eager {losses[0].item():.6f}  tpucompile {losses[1].item():.6f}  "
          f"|diff| = {loss_diff:.2e}")
    assert loss_diff < 1e-4, loss_diff
    grad_diff = max_diff(grads[1], grads[0])
    print(f"train step: max gradient difference = {grad_diff:.2e}")
    assert grad_diff < 1e-4, grad_diff
    param_diff = max_diff(model.parameters(), eager.parameters())
    print(f"train step: max parameter difference after the SGD step = {param_diff:.2e}")
    assert param_diff < 1e-4, param_diff
    stats = [(name, b) for name, b in model.named_buffers() if not name.endswith("num_batches_tracked")]
    stats_diff = max_diff([b for _, b in stats], [dict(eager.named_buffers())[name] for name, _ in stats])
    tracked = [b.item() for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]
    print(f"train step: max BatchNorm running-stat difference = {stats_diff:.2e} "
          f"(num_batches_tracked {set(tracked)})")
    assert stats_diff < 1e-4, stats_diff
    assert set(tracked) == {1}, tracked

    # Eval again: the updated running statistics are used.
    eager.eval()
    model.eval()
    with torch.no_grad():
        diff = (compiled(images) - eager(images)).abs().max().item()
    print(f"inference after the step: max |compiled - eager| = {diff:.2e}")
    assert diff < 1e-4, diff

    # Timing: training steps, after the comparisons (both copies keep training from here on).
    eager.train()
    model.train()
    eager_ms, compiled_ms = best_ms(lambda: train_step(eager, optimizers[0]),
                                    lambda: train_step(compiled, optimizers[1]))
    print(f"step time: eager {eager_ms:.1f} ms, tpucompile {compiled_ms:.1f} ms (forward+backward+SGD, batch {batch})")


if __name__ == "__main__":
    main()
