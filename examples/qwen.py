"""A Qwen-style mixture-of-experts decoder compiled with ``backend="tpucompile"``: inference, then two AdamW
training steps, each checked against the same model run eagerly.

The architecture: RMSNorm on the queries and keys of each head (QK-norm) before rotary position embeddings,
grouped-query attention, tied input/output embeddings, and a mixture-of-experts feed-forward layer: a softmax
router picks the top-k experts per token (``torch.topk``), their weights are renormalised to sum to one, and
each expert runs on every token with the tokens it was not chosen for weighted by zero (dense masking), so
every shape is static. A load-balancing loss on the router is added to the language-model loss.

    python examples/qwen.py

Random initialisation and random token data: nothing is downloaded.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from measure import best_ms


@dataclasses.dataclass
class QwenConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    n_experts: int = 4
    top_k: int = 2
    expert_hidden_dim: int = 96
    max_seq_len: int = 64
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    router_aux_loss_coef: float = 0.01


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)  # per head, shared across heads
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(batch, length, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class Expert(nn.Module):
    """A SwiGLU MLP."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.top_k, self.n_experts = config.top_k, config.n_experts
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.dim, config.expert_hidden_dim) for _ in range(config.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the layer's output and its load-balancing loss."""
        tokens = x.flatten(0, -2)  # (n, dim)
        probs = F.softmax(self.router(tokens), dim=-1)  # (n, experts)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)  # (n, k)
        top_weights = top_weights / top_weights.sum(-1, keepdim=True)
        # Dense combine weights: token i's weight for expert e, zero where e is not among its top k.
        combine = torch.zeros_like(probs).scatter(1, top_experts, top_weights)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            out = out + combine[:, index : index + 1] * expert(tokens)
        # Switch-Transformer balance loss: experts * sum_e (fraction of tokens routed to e) * (mean prob of e).
        routed = (combine > 0).float().mean(0) / self.top_k
        balance = self.n_experts * (routed * probs.mean(0)).sum()
        return out.view_as(x), balance


class Block(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MoE(config)

    def forward(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, balance = self.mlp(self.post_attention_layernorm(x))
        return x + y, balance


class Qwen(nn.Module):
    def __init__(self, config: QwenConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        nn.init.normal_(self.embed_tokens.weight, std=config.dim**-0.5)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        frequencies = config.rope_theta ** (-torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        angles = torch.outer(torch.arange(config.max_seq_len).float(), frequencies).repeat(1, 2)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, length, vocab), or with ``targets`` the cross-entropy plus the balance loss."""
        length = tokens.shape[1]
        cos, sin = self.rope_cos[:length], self.rope_sin[:length]
        x = self.embed_tokens(tokens)
        balance = x.new_zeros(())
        for layer in self.layers:
            x, layer_balance = layer(x, cos, sin)
            balance = balance + layer_balance
        logits = F.linear(self.norm(x), self.embed_tokens.weight)  # tied output head
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss + self.config.router_aux_loss_coef * balance


def main() -> None:
    torch.manual_seed(0)
    config = QwenConfig()
    eager = Qwen(config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    batch, length = 4, 32
    tokens = torch.randint(0, config.vocab_size, (batch, length))
    targets = torch.randint(0, config.vocab_size, (batch, length))

    with torch.no_grad():
        start = time.perf_counter()
        logits = compiled(tokens)
        first_call = time.perf_counter() - start
        reference = eager(tokens)
    diff = (logits - reference).abs().max().item()
    print(f"inference: logits {tuple(logits.shape)}, max |compiled - eager| = {diff:.2e} "
          f"(first call incl. compile {first_call:.2f}s)")
    assert diff < 1e-4, diff

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (eager, model)]

    def train_step(net: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = net(tokens, targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    steps = 2
    for step in range(steps):
        losses = [train_step(net, opt) for net, opt in zip((eager, compiled), optimizers, strict=True)]
        print(f"step {step}: loss eager {losses[0].item():.6f}  tpucompile {losses[1].item():.6f}")
        assert (losses[0] - losses[1]).abs().item() < 1e-4, losses
        if step == 0:
            grad_diff = max((p.grad - q.grad).abs().max().item()
                            for p, q in zip(model.parameters(), eager.parameters(), strict=True))
            router_diff = max((a.mlp.router.weight.grad - b.mlp.router.weight.grad).abs().max().item()
                              for a, b in zip(model.layers, eager.layers, strict=True))
            print(f"step 0: max gradient difference = {grad_diff:.2e} (routers {router_diff:.2e})")
            assert grad_diff < 1e-5, grad_diff
    # Adam divides each gradient by its running RMS, so rounding noise on a near-zero gradient can move a
    # parameter by up to lr per step; the bound below is lr * steps, and typically the drift is far smaller.
    drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager.parameters(), strict=True))
    print(f"max parameter difference after {steps} AdamW steps: {drift:.2e}")
    assert drift < 1e-3 * steps, drift

    eager_ms, compiled_ms = best_ms(lambda: train_step(eager, optimizers[0]),
                                    lambda: train_step(compiled, optimizers[1]))
    print(f"step time: eager {eager_ms:.1f} ms, tpucompile {compiled_ms:.1f} ms "
          f"(forward+backward+AdamW, batch {batch} x {length} tokens)")


if __name__ == "__main__":
    main()
