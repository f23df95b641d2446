"""Hugging Face decoders' own attention code on the TPU kernel route: transformers builds a boolean mask in the
graph (causal or sliding-window comparisons of index tensors, a padding mask gathered per batch row) and
repeats keys and values per query head; compiled for a TPU, each attention call reaches the splash kernel,
forward and backward. Values are checked on the CPU, against eager, with the kernel run by Pallas'
interpreter (``attention="interpret"``) for the grouped-query and sliding-window models."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from tpucompile.frontend import attention as attention_frontend

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu is not installed (pip install "tpucompile[tpu]")')
LENGTH = 128

_COMMON = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=2 * LENGTH, head_dim=32)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_COMMON, sliding_window=48))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_COMMON))


def _gemma3():
    config = dict(_COMMON, head_dim=256)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **config, sliding_window=48, layer_types=["sliding_attention", "full_attention"]))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=128, n_layer=2, n_head=2, n_positions=2 * LENGTH, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0))  # head size 64


MODELS = {"llama": (_llama, "causal & padding"), "mistral": (_mistral, "band [-47, +0] & padding"),
          "qwen3": (_qwen3, "causal & padding"), "gemma3": (_gemma3, "band [-47, +0] & padding"),
          "gpt2": (_gpt2, "causal & padding")}


def _batch():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, LENGTH), generator=generator)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, :37] = 0  # left padding: rows 0..36 of batch row 1 see no key
    return ids, mask


def _routes(monkeypatch) -> list[str]:
    """The choice written on each attention call the backend rewrites."""
    seen: list[str] = []
    original = attention_frontend.rewrite_attention

    def recording(gm, **options):
        count = original(gm, **options)
        seen.extend(n.meta["attention"] for n in gm.graph.nodes if "attention" in n.meta)
        return count

    from tpucompile import backend
    monkeypatch.setattr(backend, "rewrite_attention", recording)
    return seen


def _train_step(model, options):
    ids, mask = _batch()
    compiled = torch.compile(model, backend="tpucompile", options={"cache_mode": "off", **options})
    out = compiled(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.logits.detach(), out.loss.detach(), grads


def _eager_step(model):
    ids, mask = _batch()
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.logits.detach(), out.loss.detach(), grads


def _assert_equal_steps(actual, expected):
    torch.testing.assert_close(actual[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual[1], expected[1], atol=1e-5, rtol=1e-5)
    for got, want in zip(actual[2], expected[2], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@needs_libtpu
@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_compiled_for_a_tpu_calls_the_kernel_forward_and_backward(name, monkeypatch,
                                                                                compile_events):
    build, plan = MODELS[name]
    torch.manual_seed(0)
    model = build()
    routes = _routes(monkeypatch)
    actual = _train_step(model, {"targets": ["tpu:v5e:1x1"]})
    assert routes and all(route.startswith(f"kernel: {plan}") or (name == "gemma3" and route.startswith(
        "kernel: causal & padding")) for route in routes), routes
    on_tpu = [e for e in compile_events if e.target == "tpu:v5e:1x1" and "attention" in e.program.text()]
    assert sorted(e.name.split(" (")[1] for e in on_tpu) == ["backward)", "forward)"], [
        (e.name, e.target) for e in compile_events]
    for event in on_tpu:
        text = "".join(m.to_string() for m in event.executable.hlo_modules())
        assert text.count('custom_call_target="tpu_custom_call"') >= 2, event.name  # both layers
    _assert_equal_steps(actual, _eager_step(model))


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_training_step_with_the_kernel_interpreted_equals_eager(name):
    """The splash kernel itself (Pallas' interpreter), in the whole compiled training step, forward and
    backward: grouped-query heads, left padding with rows that see no key, and Mistral's sliding window."""
    build, _ = MODELS[name]
    torch.manual_seed(0)
    model = build()
    _assert_equal_steps(_train_step(model, {"attention": "interpret"}), _eager_step(model))
