"""A small GPT (causal self-attention) compiled with ``backend="tpucompile"``: inference, then three
training steps with AdamW, each checked against the same model run eagerly.

    python examples/mingpt.py

Random initialisation and random token data: nothing is downloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        heads = (batch, length, self.n_head, width // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation: small normal weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def main() -> None:
    torch.manual_seed(0)
    config = GPTConfig()
    eager = GPT(config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    batch = 4
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
    targets = torch.randint(0, config.vocab_size, (batch, config.block_size))

    with torch.no_grad():
        start = time.perf_counter()
        logits = compiled(idx)
        first_call = time.perf_counter() - start
        reference = eager(idx)
    diff = (logits - reference).abs().max().item()
    print(f"inference: logits {tuple(logits.shape)}, max |compiled - eager| = {diff:.2e} "
          f"(first call incl. compile {first_call:.2f}s)")
    assert diff < 1e-4, diff

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    for step in range(3):
        losses = []
        for net, optimizer in zip((eager, compiled), optimizers, strict=True):
            optimizer.zero_grad()
            loss = net(idx, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        print(f"step {step}: loss eager {losses[0]:.6f}  tpucompile {losses[1]:.6f}")
        assert abs(losses[0] - losses[1]) < 1e-4, losses
    drift = max((a - b).abs().max().item() for a, b in zip(eager.parameters(), model.parameters(), strict=True))
    print(f"max parameter difference after 3 steps: {drift:.2e}")
    assert drift < 1e-4, drift


if __name__ == "__main__":
    main()
