"""The training run the rolled-layer differential tests compare between forms: three SGD steps with momentum
of the example GPT, the last two accumulating two micro-batches, the middle one into gradients zeroed in
place."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

from mingpt import GPT, GPTConfig


def small_gpt(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=layers, n_embd=32, n_head=4, vocab_size=64, block_size=16))


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))


def sgd_steps(model: torch.nn.Module, run: Callable[..., torch.Tensor]
              ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``run`` (the model, compiled or not) trained for the three steps: the losses, the final weights and
    the final gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        optimizer.zero_grad(set_to_none=step != 1)
        for micro in range(1 + (step > 0)):
            batch = tokens(10 * step + micro)
            loss = run(batch, batch)
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, weights, grads
