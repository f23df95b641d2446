"""Models whose own code computes with complex numbers or FFTs, compiled with ``fallback="error"`` so that no
op may run in eager PyTorch: Hugging Face's Llama 4 text model (rotary embeddings through ``torch.polar`` and
``view_as_complex``), a decoder with Meta's reference rotary embedding, and Hugging Face's FNet (FFT token
mixing). Each trains side by side with its eager twin: losses, logits and every parameter's gradient at each
step."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers

STRICT = {"fallback": "error"}
aten = torch.ops.aten


def _llama4() -> torch.nn.Module:
    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, max_position_embeddings=128,
        attention_chunk_size=16, attn_implementation="sdpa")
    return transformers.Llama4ForCausalLM(config)


def _fnet() -> torch.nn.Module:
    config = transformers.FNetConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                     max_position_embeddings=64, hidden_dropout_prob=0.0)
    return transformers.FNetForMaskedLM(config)


def _rotations(head_dim: int, length: int, theta: float = 10000.0) -> torch.Tensor:
    """Meta's ``precompute_freqs_cis``: unit complex numbers e^{i·position·frequency}."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Meta's ``apply_rotary_emb``: pairs of features as complex numbers, multiplied by the rotations."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rotations[None, :, None, :]).flatten(3).type_as(x)


class _MetaDecoder(torch.nn.Module):
    """Two pre-norm decoder layers as Meta's reference Llama writes them (rotations computed in the graph)."""

    def __init__(self, vocab: int = 128, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "norm1": torch.nn.RMSNorm(width), "qkv": torch.nn.Linear(width, 3 * width, bias=False),
            "out": torch.nn.Linear(width, width, bias=False), "norm2": torch.nn.RMSNorm(width),
            "up": torch.nn.Linear(width, 4 * width, bias=False), "down": torch.nn.Linear(4 * width, width, bias=False),
        }) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        batch, length, width = x.shape
        rotations = _rotations(width // self.heads, length)
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).view(batch, length, 3, self.heads, -1).unbind(2)
            q, k = _rotate(q, rotations), _rotate(k, rotations)
            attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True)
            x = x + block["out"](attended.transpose(1, 2).reshape(batch, length, width))
            x = x + block["down"](F.silu(block["up"](block["norm2"](x))))
        return self.head(x)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(model, _MetaDecoder) or getattr(model, "_orig_mod", None).__class__ is _MetaDecoder:
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()), logits
    out = model(input_ids=ids, labels=ids)
    return out.loss, out.logits


CASES = {
    "llama4": (_llama4, {aten.polar.default, aten.view_as_complex.default, aten.view_as_real.default}),
    "meta_rope": (_MetaDecoder, {aten.polar.default, aten.view_as_complex.default, aten.view_as_real.default}),
    "fnet": (_fnet, {aten._fft_c2c.default}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_complex_and_fourier_models_train_like_eager(case, aten_ops, seeded):
    build, complex_ops = CASES[case]
    model = build()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="tpucompile", options=STRICT)
    # SGD: an update linear in the gradient (Adam's first steps would amplify rounding in near-zero ones)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    for length in (24, 24):  # the second step runs the programs the first compiled
        ids = torch.randint(0, 128, (2, length))
        (loss, logits), (got_loss, got_logits) = _loss(model, ids), _loss(compiled, ids)
        torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got_loss, loss, atol=2e-5, rtol=2e-5)
        for optimizer, value in zip(optimizers, (loss, got_loss), strict=True):
            optimizer.zero_grad()
            value.backward()
        for (name, p), q in zip(twin.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
        for optimizer in optimizers:
            optimizer.step()
    assert aten_ops >= complex_ops, complex_ops - aten_ops


def test_complex_rotary_embeddings_stay_on_buckets(seeded):
    """Lengths 6, 9 and 13 share the bucket of 16: the rotations (``polar``, ``view_as_complex``) are computed
    element by element, so their padding stays where the padder ignores it; logits and gradients equal eager."""
    import tpucompile
    from tpucompile.errors import TpuCompileWarning
    from tpucompile.metrics import compile_stats

    torch._dynamo.reset()
    compile_stats.reset()
    model = _MetaDecoder()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="tpucompile", options={**STRICT, "dynamic_mode": "bucket"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)  # a graph compiled per size fails the test
        for length in (6, 9, 13):
            ids = torch.randint(0, 128, (2, length))
            torch._dynamo.mark_dynamic(ids, 1)
            (loss, logits), (got_loss, got_logits) = _loss(model, ids), _loss(compiled, ids)
            torch.testing.assert_close(got_logits, logits, atol=2e-5, rtol=2e-5)
            model.zero_grad()
            twin.zero_grad()
            loss.backward()
            got_loss.backward()
            for (name, p), q in zip(twin.named_parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    counts = {name: (graph["compiles"], graph["bucket_hits"]) for name, graph in tpucompile.stats()["graphs"].items()}
    # graph numbers count up across a process's tests: compare the figures of the forward and the backward
    assert sorted((name.split("(")[1], figures) for name, figures in counts.items()) == [
        ("backward)", (1, 2)), ("forward)", (1, 2))], counts


def test_a_transform_over_a_padded_dimension_compiles_per_size_and_says_why(seeded):
    from tpucompile.errors import TpuCompileWarning

    model = _fnet()
    compiled = torch.compile(copy.deepcopy(model), backend="tpucompile", options={**STRICT, "dynamic_mode": "bucket"})
    ids = torch.randint(0, 128, (2, 9))
    torch._dynamo.mark_dynamic(ids, 1)
    with pytest.warns(TpuCompileWarning, match=r"once per size.*aten\._fft_c2c.*it transforms over a padded dim"):
        got = _loss(compiled, ids)[1]
    torch.testing.assert_close(got, _loss(model, ids)[1], atol=2e-5, rtol=2e-5)
