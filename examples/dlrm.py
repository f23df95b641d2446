"""A DLRM-style recommendation model compiled with ``backend="tpucompile"``: inference, then one SGD training
step with a binary cross-entropy loss, each checked against the same model run eagerly.

Dense features go through a bottom MLP; each sparse feature is a bag of ids (a flat index tensor plus offsets,
bags of different lengths) summed by an ``nn.EmbeddingBag``; the dense vector and the bag embeddings interact
through all pairwise dot products, which a top MLP turns into a click probability.

    python examples/dlrm.py

Random initialisation and random features and labels: nothing is downloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from measure import best_ms, max_diff


@dataclasses.dataclass
class DLRMConfig:
    dense_features: int = 13
    table_sizes: tuple[int, ...] = (100, 40, 250, 16)
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 32)
    top_mlp: tuple[int, ...] = (64, 32)
    max_bag_size: int = 4


def mlp(sizes: list[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if last_activation or index < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.embedding_dim
        self.bottom = mlp([config.dense_features, *config.bottom_mlp, dim], last_activation=True)
        self.tables = nn.ModuleList(nn.EmbeddingBag(size, dim, mode="sum") for size in config.table_sizes)
        for table in self.tables:
            nn.init.uniform_(table.weight, -(table.num_embeddings**-0.5), table.num_embeddings**-0.5)
        features = len(config.table_sizes) + 1
        rows, cols = torch.triu_indices(features, features, offset=1)  # each unordered pair once
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        self.top = mlp([dim + rows.numel(), *config.top_mlp, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        """Returns one logit per example; ``indices[t]``/``offsets[t]`` are table t's bags, as in EmbeddingBag."""
        x = self.bottom(dense)
        bags = [table(ids, offs) for table, ids, offs in zip(self.tables, indices, offsets, strict=True)]
        features = torch.stack([x, *bags], dim=1)  # (batch, 1 + tables, dim)
        dots = torch.bmm(features, features.transpose(1, 2))  # (batch, 1 + tables, 1 + tables)
        pairs = dots[:, self.pair_rows, self.pair_cols]  # strictly upper triangle
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


def make_batch(config: DLRMConfig, batch: int, generator: torch.Generator):
    dense = torch.randn(batch, config.dense_features, generator=generator)
    indices, offsets = [], []
    for size in config.table_sizes:
        lengths = torch.randint(1, config.max_bag_size + 1, (batch,), generator=generator)
        offsets.append(torch.cumsum(lengths, 0) - lengths)  # start of each bag
        indices.append(torch.randint(0, size, (int(lengths.sum()),), generator=generator))
    labels = torch.randint(0, 2, (batch,), generator=generator).float()
    return dense, indices, offsets, labels


def main() -> None:
    torch.manual_seed(0)
    config = DLRMConfig()
    eager = DLRM(config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    batch = 32
    dense, indices, offsets, labels = make_batch(config, batch, torch.Generator().manual_seed(1))

    with torch.no_grad():
        start = time.perf_counter()
        logits = compiled(dense, indices, offsets)
        first_call = time.perf_counter() - start
        reference = eager(dense, indices, offsets)
    diff = (logits - reference).abs().max().item()
    print(f"inference: logits {tuple(logits.shape)}, max |compiled - eager| = {diff:.2e} "
          f"(first call incl. compile {first_call:.2f}s)")
    assert diff < 1e-4, diff
    # Another batch: the bags have other lengths, so the flat index tensors have other sizes.
    other = make_batch(config, batch, torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (compiled(*other[:3]) - eager(*other[:3])).abs().max().item()
    sizes = [ids.numel() for ids in other[1]]
    print(f"inference, another batch (bag ids per table {sizes}): max |compiled - eager| = {diff:.2e}")
    assert diff < 1e-4, diff

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]

    def train_step(net: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(net(dense, indices, offsets), labels)
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
    table_grad_diff = max_diff([t.weight.grad for t in model.tables], [t.weight.grad for t in eager.tables])
    grad_diff = max_diff(grads[1], grads[0])
    print(f"train step: max gradient difference = {grad_diff:.2e} (embedding tables {table_grad_diff:.2e})")
    assert grad_diff < 1e-4, grad_diff
    param_diff = max_diff(model.parameters(), eager.parameters())
    print(f"train step: max parameter difference after the SGD step = {param_diff:.2e}")
    assert param_diff < 1e-4, param_diff

    eager_ms, compiled_ms = best_ms(lambda: train_step(eager, optimizers[0]),
                                    lambda: train_step(compiled, optimizers[1]))
    print(f"step time: eager {eager_ms:.1f} ms, tpucompile {compiled_ms:.1f} ms (forward+backward+SGD, batch {batch})")


if __name__ == "__main__":
    main()
