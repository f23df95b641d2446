"""A LLaMA-style decoder compiled with ``backend="tpucompile"``: three AdamW training steps, then greedy
generation with a KV cache, each checked against the same model run eagerly (losses, first-step gradients,
parameters, every step's logits and the generated tokens).

The architecture: rotary position embeddings (RoPE), RMSNorm before attention and MLP, grouped-query
attention (fewer key/value heads than query heads), a SwiGLU MLP and an untied output head. Generation fills a
static-size KV cache with the prompt (prefill), then decodes one token at a time; the cache is a module buffer
updated in place with ``index_copy_`` at tensor positions, so every decode step has the same shapes and runs
the same compiled program.

    python examples/llama.py
    python examples/llama.py --mesh data=2,model=4    # one SPMD program over 8 devices (virtual CPU ones
                                                      # here), checked against the run on one device

Random initialisation and random token data: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from measure import best_ms


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 176  # SwiGLU width, about 8/3 * dim
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, shape (max_seq_len, head_dim // 2)."""
    frequencies = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of each head by the position's angles.

    ``x`` is (batch, heads, length, head_dim); ``cos``/``sin`` are (length, head_dim // 2).
    """
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.n_heads % config.n_kv_heads == 0
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.register_buffer("cache_k", None, persistent=False)  # allocated by setup_cache
        self.register_buffer("cache_v", None, persistent=False)

    def setup_cache(self, batch: int, max_seq_len: int) -> None:
        shape = (batch, self.n_kv_heads, max_seq_len, self.head_dim)
        self.cache_k = torch.zeros(shape)
        self.cache_v = torch.zeros(shape)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                use_cache: bool) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.wq(x).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if use_cache:
            assert self.cache_k is not None and self.cache_v is not None, "call setup_cache first"
            self.cache_k.index_copy_(2, positions, k)
            self.cache_v.index_copy_(2, positions, v)
            k, v = self.cache_k, self.cache_v
            key_positions = torch.arange(k.shape[2], device=x.device)
        else:
            key_positions = positions
        # A query sees the keys at its own position and before; unwritten cache slots lie after it.
        mask = key_positions[None, :] <= positions[:, None]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, positions, cos, sin, use_cache: bool) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions, cos, sin, use_cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(config.dim // config.n_heads, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def setup_cache(self, batch: int) -> None:
        for layer in self.layers:
            layer.attention.setup_cache(batch, self.config.max_seq_len)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, use_cache: bool = False) -> torch.Tensor:
        """Logits for ``tokens`` (batch, length) at ``positions`` (length,), or the loss against ``targets``.

        With ``use_cache`` the keys and values are written into the KV cache at ``positions`` and attention
        reads the whole cache.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, positions, cos, sin, use_cache)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def generate(model: Callable, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding with the KV cache: returns the generated tokens and each step's last-position logits."""
    length = prompt.shape[1]
    logits = model(prompt, torch.arange(length), use_cache=True)[:, -1]
    steps = [logits]
    tokens = [logits.argmax(-1, keepdim=True)]  # (batch, 1)
    for position in range(length, length + new_tokens - 1):
        logits = model(tokens[-1], torch.tensor([position]), use_cache=True)[:, -1]
        steps.append(logits)
        tokens.append(logits.argmax(-1, keepdim=True))
    return torch.cat(tokens, dim=1), steps


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig()
    eager = Llama(config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile")
    batch, length = 4, 32
    tokens = torch.randint(0, config.vocab_size, (batch, length))
    targets = torch.randint(0, config.vocab_size, (batch, length))

    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (eager, model)]

    def train_step(net: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = net(tokens, targets=targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    for step in range(3):
        losses = [train_step(net, opt) for net, opt in zip((eager, compiled), optimizers, strict=True)]
        print(f"step {step}: loss eager {losses[0].item():.6f}  tpucompile {losses[1].item():.6f}")
        assert (losses[0] - losses[1]).abs().item() < 1e-4, losses
        if step == 0:
            grad_diff = max((p.grad - q.grad).abs().max().item()
                            for p, q in zip(model.parameters(), eager.parameters(), strict=True))
            print(f"step 0: max gradient difference = {grad_diff:.2e}")
            assert grad_diff < 1e-5, grad_diff
    # Adam divides each gradient by its running RMS, so rounding noise on a near-zero gradient can move a
    # parameter by up to lr per step; the bound below is lr * steps, and typically the drift is far smaller.
    drift = max((p - q).abs().max().item() for p, q in zip(model.parameters(), eager.parameters(), strict=True))
    print(f"max parameter difference after 3 AdamW steps: {drift:.2e}")
    assert drift < 3e-3, drift

    # Greedy generation with a static-size KV cache: prefill the prompt, then one token per call. Both copies
    # generate with the same weights (the eager copy's), so only the compiler can make them differ.
    with torch.no_grad():
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            p.copy_(q)
    prompt_length, new_tokens = 8, 24
    prompt = tokens[:2, :prompt_length]
    eager.setup_cache(prompt.shape[0])
    model.setup_cache(prompt.shape[0])
    eager_tokens, eager_steps = generate(eager, prompt, new_tokens)
    start = time.perf_counter()
    compiled_tokens, compiled_steps = generate(compiled, prompt, new_tokens)
    first_generate = time.perf_counter() - start
    logit_diff = max((a - b).abs().max().item() for a, b in zip(compiled_steps, eager_steps, strict=True))
    same = torch.equal(compiled_tokens, eager_tokens)
    print(f"inference (prefill + {new_tokens - 1} decode steps): max |compiled - eager| logits = {logit_diff:.2e} "
          f"(first run incl. compile {first_generate:.2f}s)")
    print(f"generation: {new_tokens} tokens x {prompt.shape[0]} sequences, identical tokens: {same}; "
          f"first sequence {compiled_tokens[0, :12].tolist()} ...")
    assert logit_diff < 1e-4, logit_diff
    assert same, (compiled_tokens, eager_tokens)

    eager_ms, compiled_ms = best_ms(lambda: train_step(eager, optimizers[0]),
                                    lambda: train_step(compiled, optimizers[1]))
    print(f"step time: eager {eager_ms:.1f} ms, tpucompile {compiled_ms:.1f} ms "
          f"(forward+backward+AdamW, batch {batch} x {length} tokens)")
    next_token, position = compiled_tokens[:, -1:].clone(), torch.tensor([prompt_length + new_tokens])
    with torch.no_grad():
        eager_ms, compiled_ms = best_ms(lambda: eager(next_token, position, use_cache=True),
                                        lambda: compiled(next_token, position, use_cache=True))
    print(f"decode time per token: eager {eager_ms:.2f} ms, tpucompile {compiled_ms:.2f} ms")


def sharding_plan(mesh):
    """Data parallel over ``data`` (tokens split by batch), Megatron tensor parallel over ``model``: the query
    projection (by heads) and the SwiGLU up projections split by output features, the attention and MLP output
    projections by input features, the vocabulary head by vocabulary. With fewer key/value heads than the
    ``model`` axis has devices, the key and value projections stay whole (as Megatron does)."""
    from tpucompile import data_parallel, tensor_parallel

    column = ["layers.*.attention.wq", "layers.*.feed_forward.w1", "layers.*.feed_forward.w3", "output"]
    row = ["layers.*.attention.wo", "layers.*.feed_forward.w2"]
    return data_parallel(mesh) + tensor_parallel(mesh, column=column, row=row)


def main_mesh(mesh_text: str) -> None:
    """Train and generate on a device mesh, against the same model compiled for one device."""
    from tpucompile import Mesh

    mesh = Mesh.parse(mesh_text)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:  # virtual CPU devices, before jax starts
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={mesh.size}".strip()
    torch.manual_seed(0)
    config = LlamaConfig()
    single_model = Llama(config)
    mesh_model = copy.deepcopy(single_model)
    single = torch.compile(single_model, backend="tpucompile")
    sharded = torch.compile(mesh_model, backend="tpucompile",
                            options={"mesh": mesh, "shard": sharding_plan(mesh)})
    batch, length = 4, 32
    tokens = torch.randint(0, config.vocab_size, (batch, length))
    targets = torch.randint(0, config.vocab_size, (batch, length))
    models = (single_model, mesh_model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in models]

    def train_step(net: Callable, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = net(tokens, targets=targets)
        loss.backward()
        optimizer.step()
        return loss.detach()

    print(f"mesh {mesh!r}: {mesh.size} devices, {len(sharding_plan(mesh).rules)} sharding rules")
    start = time.perf_counter()
    for step in range(3):
        losses = [train_step(net, opt) for net, opt in zip((single, sharded), optimizers, strict=True)]
        print(f"step {step}: loss one device {losses[0].item():.6f}  mesh {losses[1].item():.6f}")
        assert (losses[0] - losses[1]).abs().item() < 1e-5, losses
    drift = max((p - q).abs().max().item() for p, q in zip(*(m.parameters() for m in models), strict=True))
    print(f"max parameter difference after 3 AdamW steps: {drift:.2e} "
          f"(first run incl. compiles {time.perf_counter() - start:.1f}s)")
    assert drift < 1e-4, drift

    prompt = tokens[:2, :8]
    for model in models:
        model.setup_cache(prompt.shape[0])
    single_tokens, single_steps = generate(single, prompt, 24)
    mesh_tokens, mesh_steps = generate(sharded, prompt, 24)
    logit_diff = max((a - b).abs().max().item() for a, b in zip(mesh_steps, single_steps, strict=True))
    same = torch.equal(mesh_tokens, single_tokens)
    print(f"generation (prefill + 23 decode steps): max |mesh - one device| logits = {logit_diff:.2e}, "
          f"identical tokens: {same}")
    assert logit_diff < 1e-4 and same, (logit_diff, mesh_tokens, single_tokens)
    single_ms, mesh_ms = best_ms(lambda: train_step(single, optimizers[0]),
                                 lambda: train_step(sharded, optimizers[1]))
    print(f"step time: one device {single_ms:.1f} ms, mesh {mesh_ms:.1f} ms")
    print(f"agreement with one device: losses, parameters and generated tokens match on {mesh!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", help="run as one SPMD program over a device mesh, e.g. data=2,model=4")
    arguments = parser.parse_args()
    if arguments.mesh:
        main_mesh(arguments.mesh)
    else:
        main()
