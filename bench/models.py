"""The benchmarked workloads: every example model at its CPU-sized config and at sizes people run, a batch and
a training loss.

Each workload builds a fresh, seeded model and batch, so that every backend in every process measures the
same numbers on the same values.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))


@dataclasses.dataclass
class Workload:
    model: nn.Module
    inputs: tuple
    """Arguments of an inference call."""
    loss: Callable[[Callable], torch.Tensor]
    """The training loss, given the (compiled or eager) model to call."""
    eval_for_inference: bool = False
    """Put the model in eval mode for inference (BatchNorm uses its running statistics)."""


def mlp(device: str) -> Workload:
    from mlp import make_mlp

    model = make_mlp().to(device)
    x, labels = _on(device, (torch.randn(64, 256), torch.randint(0, 10, (64,))))
    return Workload(model, (x,), lambda net: F.cross_entropy(net(x), labels))


def gpt(device: str) -> Workload:
    from mingpt import GPT, GPTConfig

    config = GPTConfig()
    model = GPT(config).to(device)
    idx = _on(device, torch.randint(0, config.vocab_size, (4, config.block_size)))
    targets = _on(device, torch.randint(0, config.vocab_size, (4, config.block_size)))
    return Workload(model, (idx,), lambda net: net(idx, targets))


def gpt_384(device: str) -> Workload:
    """A size people train: 4 blocks of width 384 (6 heads) on 8 sequences of 256 tokens."""
    from mingpt import GPT, GPTConfig

    config = GPTConfig(block_size=256, n_layer=4, n_head=6, n_embd=384)
    model = GPT(config).to(device)
    idx = _on(device, torch.randint(0, config.vocab_size, (8, config.block_size)))
    targets = _on(device, torch.randint(0, config.vocab_size, (8, config.block_size)))
    return Workload(model, (idx,), lambda net: net(idx, targets))


def llama(device: str) -> Workload:
    from llama import Llama, LlamaConfig

    config = LlamaConfig()
    model = Llama(config).to(device)
    tokens = _on(device, torch.randint(0, config.vocab_size, (4, 32)))
    targets = _on(device, torch.randint(0, config.vocab_size, (4, 32)))
    return Workload(model, (tokens,), lambda net: net(tokens, targets=targets))


def qwen(device: str) -> Workload:
    from qwen import Qwen, QwenConfig

    config = QwenConfig()
    model = Qwen(config).to(device)
    tokens = _on(device, torch.randint(0, config.vocab_size, (4, 32)))
    targets = _on(device, torch.randint(0, config.vocab_size, (4, 32)))
    return Workload(model, (tokens,), lambda net: net(tokens, targets))


def resnet(device: str) -> Workload:
    from resnet import ResNet, ResNetConfig

    config = ResNetConfig()
    return _images(ResNet(config), config, device)


def resnet18(device: str) -> Workload:
    from resnet import RESNET_18, ResNet

    return _images(ResNet(RESNET_18), RESNET_18, device)


def densenet121(device: str) -> Workload:
    from densenet import DENSENET_121, DenseNet

    return _images(DenseNet(DENSENET_121), DENSENET_121, device)


def _images(model: nn.Module, config, device: str, batch: int = 8) -> Workload:
    """An image classifier's workload: a batch of random images and labels, cross-entropy."""
    model = model.to(device)
    images = _on(device, torch.randn(batch, config.in_channels, config.image_size, config.image_size))
    labels = _on(device, torch.randint(0, config.num_classes, (batch,)))
    return Workload(model, (images,), lambda net: F.cross_entropy(net(images), labels), eval_for_inference=True)


def unet(device: str) -> Workload:
    from unet import UNet, UNetConfig

    config = UNetConfig()
    model = UNet(config).to(device)
    images = _on(device, torch.randn(4, config.in_channels, config.image_size, config.image_size))
    masks = _on(device, torch.randint(0, config.num_classes, (4, config.image_size, config.image_size)))
    return Workload(model, (images,), lambda net: F.cross_entropy(net(images), masks), eval_for_inference=True)


def dlrm(device: str) -> Workload:
    from dlrm import DLRM, DLRMConfig, make_batch

    config = DLRMConfig()
    model = DLRM(config).to(device)
    dense, indices, offsets, labels = _on(device, make_batch(config, 32, torch.Generator().manual_seed(1)))
    return Workload(model, (dense, indices, offsets),
                    lambda net: F.binary_cross_entropy_with_logits(net(dense, indices, offsets), labels))


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp": mlp, "gpt": gpt, "llama": llama, "qwen": qwen, "resnet": resnet, "unet": unet, "dlrm": dlrm,
    "gpt-384": gpt_384, "resnet18": resnet18, "densenet121": densenet121,
}
"""The examples' small configs, then sizes people run (``gpt-384``, ``resnet18``, ``densenet121``)."""


def build(name: str, device: str = "cpu") -> Workload:
    torch.manual_seed(0)
    return WORKLOADS[name](device)


def _on(device: str, value):
    """``value`` (a tensor, or lists and tuples of them) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return type(value)(_on(device, v) for v in value)
