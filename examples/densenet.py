"""DenseNet (Huang et al.: dense blocks whose layers each see the concatenation of every earlier layer's
output) compiled with ``backend="tpucompile"``: inference, then one SGD training step in train mode, its
loss, gradients and BatchNorm statistics checked against the same model run eagerly.

    python examples/densenet.py            # a small DenseNet on 32x32 images
    python examples/densenet.py --121      # DenseNet-121's layout on 64x64 images (slower)

Random initialisation and random images: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from measure import best_ms, max_diff


@dataclasses.dataclass
class DenseNetConfig:
    in_channels: int = 3
    image_size: int = 32
    stem_width: int = 32
    growth: int = 12
    blocks: tuple[int, ...] = (2, 3, 2)
    bottleneck: int = 4
    """Each layer's 1x1 convolution widens to ``bottleneck * growth`` channels before its 3x3 one."""
    num_classes: int = 10


DENSENET_121 = DenseNetConfig(image_size=64, stem_width=64, growth=32, blocks=(6, 12, 24, 16))


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv, BN-ReLU-3x3 conv: ``growth`` new channels from all the block's channels so far."""

    def __init__(self, channels: int, growth: int, bottleneck: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(channels)
        self.conv1 = nn.Conv2d(channels, bottleneck * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bottleneck * growth)
        self.conv2 = nn.Conv2d(bottleneck * growth, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(F.relu(self.norm1(x)))
        return torch.cat([x, self.conv2(F.relu(self.norm2(y)))], 1)


class Transition(nn.Sequential):
    """Halve the channels (1x1 conv) and the resolution (2x2 average pooling) between dense blocks."""

    def __init__(self, channels: int) -> None:
        super().__init__(nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels // 2, 1, bias=False),
                         nn.AvgPool2d(2))


class DenseNet(nn.Module):
    def __init__(self, config: DenseNetConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(config.in_channels, config.stem_width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(config.stem_width), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1),
        ]
        channels = config.stem_width
        for index, count in enumerate(config.blocks):
            for _ in range(count):
                layers.append(DenseLayer(channels, config.growth, config.bottleneck))
                channels += config.growth
            if index < len(config.blocks) - 1:
                layers.append(Transition(channels))
                channels //= 2
        layers += [nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, config.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--121", dest="full", action="store_true", help="DenseNet-121's layout on 64x64 images")
    config = DENSENET_121 if parser.parse_args().full else DenseNetConfig()
    torch.manual_seed(0)
    eager = DenseNet(config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    batch = 4
    images = torch.randn(batch, config.in_channels, config.image_size, config.image_size)
    labels = torch.randint(0, config.num_classes, (batch,))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (eager, model)]

    # Inference in eval mode (BatchNorm's running statistics), then training in train mode.
    eager.eval()
    model.eval()
    with torch.no_grad():
        logits = compiled(images)
        diff = (logits - eager(images)).abs().max().item()
    print(f"inference: logits {tuple(logits.shape)}, max |compiled - eager| = {diff:.2e}")
    assert diff < 1e-4, diff
    eager.train()
    model.train()

    def train_step(net: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(net(images), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = [train_step(net, optimizer) for net, optimizer in zip((eager, compiled), optimizers, strict=True)]
    loss_diff = (losses[0] - losses[1]).abs().item()
    print(f"train step: loss eager {losses[0].item():.6f}  tpucompile {losses[1].item():.6f}  "
          f"|diff| = {loss_diff:.2e}")
    assert loss_diff < 1e-4, loss_diff
    # Gradients relative to the model's largest one: layers deep in a dense block have tiny gradients.
    scale = max(p.grad.abs().max().item() for p in eager.parameters())
    grad_diff = max_diff([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()]) / scale
    print(f"train step: max gradient difference = {grad_diff:.2e} of the largest gradient")
    assert grad_diff < 1e-4, grad_diff
    stats = [(name, b) for name, b in model.named_buffers() if not name.endswith("num_batches_tracked")]
    stats_diff = max_diff([b for _, b in stats], [dict(eager.named_buffers())[name] for name, _ in stats])
    print(f"train step: max BatchNorm running-stat difference = {stats_diff:.2e}")
    assert stats_diff < 1e-4, stats_diff
    eager_ms, compiled_ms = best_ms(lambda: train_step(eager, optimizers[0]),
                                    lambda: train_step(compiled, optimizers[1]))
    print(f"step time: eager {eager_ms:.1f} ms, tpucompile {compiled_ms:.1f} ms (forward+backward+SGD, batch {batch})")


if __name__ == "__main__":
    main()
