"""Hugging Face transformers models, random-initialised from small configs, with sequence lengths that change
from call to call: on buckets (``dynamic_mode="bucket"``) every length inside a bucket reuses one executable, and
results, gradients and greedily generated tokens equal eager PyTorch's."""

from __future__ import annotations

import copy
import logging
import re
import warnings

import pytest
import torch
import transformers

import tpucompile
from tests.support import assert_close_tree, crossed_padded
from tpucompile.errors import TpuCompileWarning
from tpucompile.metrics import compile_stats

BUCKETED = {"dynamic_mode": "bucket"}


def _bert() -> transformers.PreTrainedModel:
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def _llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config)


def _mistral() -> transformers.PreTrainedModel:
    """A sliding window of 8: prompts up to 7 tokens take the whole window (its cache's slice from the end is
    the whole sequence, forward and backward), longer ones a part of it."""
    config = transformers.MistralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                                        sliding_window=8)
    return transformers.MistralForCausalLM(config)


def _t5() -> transformers.PreTrainedModel:
    """An encoder-decoder: the decoder's inputs are the labels shifted right inside the graph."""
    config = transformers.T5Config(vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def _bucket_compiles(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "for a new bucket" in r.getMessage()]


@pytest.mark.parametrize(("build", "padded"), [
    (_bert, False), (_bert, True), (_llama, False), (_llama, True), (_mistral, True), (_t5, True),
], ids=["bert-no-mask", "bert-padding-mask", "llama-no-mask", "llama-padding-mask", "mistral-window-padding-mask",
        "t5-padding-mask"])
def test_variable_length_training_on_buckets(build, padded, caplog, seeded):
    """Lengths 6 and 13 share the bucket of 16 and 21 takes 32 (one compile each): logits, loss and every
    parameter's gradient equal eager at each length, with no graph falling back to per-size compiles (the loss
    pads the shifted labels and its backward scatters into the hidden states: both stay on buckets). With a
    padding mask (the second sequence's first two tokens masked), Hugging Face's mask builder indexes the
    mask per batch row and key position inside the graph: that gather stays on buckets too. Mistral's
    sliding-window cache slices the last positions of a sequence no longer than its window, and T5 shifts its
    labels right into the decoder's inputs by a copy into a slice: both stay on buckets."""
    caplog.set_level(logging.INFO, logger="tpucompile")
    model = build()
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="tpucompile", options=BUCKETED)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)
        for length in (6, 13, 21):
            ids = torch.randint(0, model.config.vocab_size, (2, length))
            torch._dynamo.mark_dynamic(ids, 1)  # no static graph for the first length
            inputs = {"input_ids": ids, "labels": ids}
            if padded:
                inputs["attention_mask"] = torch.ones(2, length, dtype=torch.long)
                inputs["attention_mask"][1, :2] = 0
                torch._dynamo.mark_dynamic(inputs["attention_mask"], 1)
            expected = model(**inputs)
            got = compiled(**inputs)
            assert_close_tree(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
            assert_close_tree(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
            model.zero_grad()
            compiled_model.zero_grad()
            expected.loss.backward()
            got.loss.backward()
            for (name, p), q in zip(compiled_model.named_parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    buckets = {bucket for m in _bucket_compiles(caplog) for bucket in re.findall(r"-> bucket (\d+)", m)}
    assert buckets == {"32"}, _bucket_compiles(caplog)  # the first call compiles 16, 21 takes 32


def _greedy(model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with the model's key/value cache: one token per call after the prompt."""
    out = model(input_ids=prompt, use_cache=True)
    tokens, logits = [], []
    for _ in range(steps):
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token)
        out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, 1), torch.stack(logits, 1)


def _mistral_wide_window() -> transformers.PreTrainedModel:
    """Mistral with a window wider than the sequences decoded: its cache layers grow like Llama's and count
    the tokens seen, a length each decoding graph returns as a size."""
    config = transformers.MistralConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                                        sliding_window=64)
    return transformers.MistralForCausalLM(config)


@pytest.mark.parametrize("build", [_llama, _mistral_wide_window], ids=["llama", "mistral-window"])
def test_greedy_generation_with_a_growing_cache(build, caplog, monkeypatch, seeded):
    """Each decoding step concatenates one token to a cache of runtime length, takes the last position, and
    counts positions from the cache's length: 20 tokens after a prompt of 6 need two buckets (16 and 32) of the
    decoding graph, and the tokens and logits equal eager's. The cache each step returns goes back into the
    next as the padded buffer it was cut from (``runtime/padded_results``): in all but the first two steps and
    the first of bucket 32, every layer's keys and values, also where the graph returns sizes beside them
    (Mistral's sliding-window layers)."""
    caplog.set_level(logging.INFO, logger="tpucompile")
    compile_stats.reset()
    crossed = crossed_padded(monkeypatch)
    model = build().eval()
    compiled = torch.compile(model, backend="tpucompile", options=BUCKETED)
    prompt = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", TpuCompileWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renames past_key_values
        expected_tokens, expected_logits = _greedy(model, prompt, 20)
        tokens, logits = _greedy(compiled, prompt, 20)
    assert torch.equal(tokens, expected_tokens)
    assert_close_tree(logits, expected_logits, atol=1e-5, rtol=1e-5)
    bucketed = [g for g in tpucompile.stats()["graphs"].values() if g["bucket_hits"]]
    assert len(bucketed) == 1, tpucompile.stats()
    (decoding,) = bucketed
    assert decoding["compiles"] + sum(decoding["hits"].values()) == 2
    assert decoding["compiles"] + sum(decoding["hits"].values()) + decoding["bucket_hits"] >= 18
    caches = 2 * model.config.num_hidden_layers  # keys and values per layer
    assert len(crossed) % caches == 0 and len(crossed) // caches >= 16, len(crossed)
    per_step = [crossed[i:i + caches] for i in range(0, len(crossed), caches)]
    assert all(len(set(step)) == 1 for step in per_step), per_step  # all of a step's caches, or none
    assert [step[0] for step in per_step].count(False) <= 3, per_step


def test_decoding_steps_taken_back_from_the_cache(seeded):
    """A step decoded and then taken back (``DynamicCache.crop``, as assisted decoding does with a rejected
    draft) leaves the cache a slice of a longer buffer, whose stride Dynamo then traces as a size of its own:
    the decoding graph is rolled (its layers' shapes are fixed) while the program still has that runtime
    size. It compiled with an error ("a rolled loop in a program with runtime sizes") before; the logits
    equal eager's."""
    model = _llama().eval()
    compiled = torch.compile(model, backend="tpucompile", options=BUCKETED)
    prompt = torch.randint(0, model.config.vocab_size, (2, 10))
    token = torch.randint(0, model.config.vocab_size, (2, 1))

    def taken_back(net) -> list[torch.Tensor]:
        torch._dynamo.mark_dynamic(prompt, 1)
        cache = net(input_ids=prompt, use_cache=True).past_key_values
        logits = []
        for _ in range(3):
            logits.append(net(input_ids=token, past_key_values=cache, use_cache=True).logits)
            cache.crop(-1)
        return logits

    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renames past_key_values
        expected = taken_back(model)
        got = taken_back(compiled)
    assert_close_tree(got, expected, atol=1e-5, rtol=1e-5)
