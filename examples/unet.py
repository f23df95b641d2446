"""A small UNet (segmentation) compiled with ``backend="tpucompile"``: inference, then one SGD training step,
each checked against the same model run eagerly.

The encoder halves the resolution with max pooling; the decoder doubles it again, with a transposed convolution
on one level and bilinear upsampling followed by a 1x1 convolution on the other, and concatenates the encoder's
features at each level (the skip connections).

    python examples/unet.py

Random initialisation, random images and random per-pixel labels: nothing is downloaded.
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
class UNetConfig:
    in_channels: int = 3
    num_classes: int = 4
    image_size: int = 32
    base_width: int = 8
    # One entry per decoder level, deepest first: "transpose" (ConvTranspose2d) or "bilinear" / "nearest"
    # (F.interpolate then a 1x1 convolution). The encoder has as many pooling steps as there are entries.
    up_modes: tuple[str, ...] = ("transpose", "bilinear")


class ConvBlock(nn.Sequential):
    """(3x3 conv, BatchNorm, ReLU) twice."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )


class Up(nn.Module):
    """Double the resolution and halve the width, concatenate the skip features, then a ConvBlock."""

    def __init__(self, in_channels: int, out_channels: int, mode: str) -> None:
        super().__init__()
        self.mode = mode
        if mode == "transpose":
            self.up = nn.ConvTranspose2d(in_channels, out_channels, kernel_size=2, stride=2)
        else:
            self.up = nn.Conv2d(in_channels, out_channels, kernel_size=1)
        self.block = ConvBlock(2 * out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        if self.mode == "transpose":
            x = self.up(x)
        else:
            align = False if self.mode == "bilinear" else None
            x = self.up(F.interpolate(x, scale_factor=2, mode=self.mode, align_corners=align))
        return self.block(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.base_width * 2**level for level in range(len(config.up_modes) + 1)]
        self.inc = ConvBlock(config.in_channels, widths[0])
        self.down = nn.ModuleList(ConvBlock(widths[i], widths[i + 1]) for i in range(len(widths) - 1))
        self.up = nn.ModuleList(
            Up(widths[i + 1], widths[i], mode)
            for i, mode in zip(reversed(range(len(widths) - 1)), config.up_modes, strict=True)
        )
        self.head = nn.Conv2d(widths[0], config.num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = []
        for block in self.down:
            skips.append(x)
            x = block(F.max_pool2d(x, 2))
        for up, skip in zip(self.up, reversed(skips), strict=True):
            x = up(x, skip)
        return self.head(x)


def main() -> None:
    torch.manual_seed(0)
    config = UNetConfig()
    eager = UNet(config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    batch = 4
    images = torch.randn(batch, config.in_channels, config.image_size, config.image_size)
    masks = torch.randint(0, config.num_classes, (batch, config.image_size, config.image_size))

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
    assert logits.shape == (batch, config.num_classes, config.image_size, config.image_size), logits.shape
    assert diff < 1e-4, diff

    eager.train()
    model.train()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, model)]

    def train_step(net: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(net(images), masks)  # per-pixel classification
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = []
    grads = []
    for net, params, optimizer in zip((eager, compiled), (eager, model), optimizers, strict=True):
        losses.append(train_step(net, optimizer))
        grads.append([p.grad.clone() for p in params.parameters()])
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
    stats_diff = max_diff(model.buffers(), eager.buffers())
    print(f"train step: max BatchNorm running-stat difference = {stats_diff:.2e}")
    assert stats_diff < 1e-4, stats_diff

    eager_ms, compiled_ms = best_ms(lambda: train_step(eager, optimizers[0]),
                                    lambda: train_step(compiled, optimizers[1]))
    print(f"step time: eager {eager_ms:.1f} ms, tpucompile {compiled_ms:.1f} ms (forward+backward+SGD, batch {batch})")


if __name__ == "__main__":
    main()
