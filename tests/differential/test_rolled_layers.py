"""Rolled layers against unrolled ones and eager: Hugging Face's own decoder and encoder stacks, trained at two
sequence lengths (against eager at both, against the unrolled stacks at the first; T5, whose encoder and decoder
each roll, at the first only), forward and every gradient, with the roll proved to have happened (a loop in the
programs)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tpucompile import driver  # noqa: E402
from tpucompile.contracts.loop_ops import is_loop  # noqa: E402

SIZE = dict(vocab_size=128, max_position_embeddings=128)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        **SIZE))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, **SIZE))


def _mistral():
    """Without its cache: the sliding-window cache keeps an integer length per layer, which stays unrolled
    (``tests/frontend/test_layer_rolling.py``)."""
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=8, use_cache=False, **SIZE))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_positions=128, n_embd=64, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **SIZE))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=64, d_ff=128, num_layers=3, num_heads=4, d_kv=16, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))


MODELS = {"llama": _llama, "qwen3": _qwen3, "mistral": _mistral, "gpt2": _gpt2, "bert": _bert, "t5": _t5}


def _loss(model, tokens: torch.Tensor, valid: torch.Tensor, labelled: bool) -> torch.Tensor:
    """A loss of every logit (an encoder-decoder's decoder reads the tokens reversed, shifted right)."""
    labels = {"labels": tokens.flip(1)} if labelled else {}
    return model(input_ids=tokens, attention_mask=valid, **labels).logits.float().pow(2).mean()


def _step(model, compiled, tokens, valid) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = _loss(compiled, tokens, valid, model.config.is_encoder_decoder)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rolled_stacks_train_like_unrolled_and_eager(name, cache_dir):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.config._attn_implementation = "sdpa"
    loops: list[str] = []
    remove = driver.add_observer(lambda event: loops.extend(
        event.name for n in (event.graph.graph.nodes if event.graph is not None else ()) if is_loop(n)))
    try:
        for length in (12,) if name == "t5" else (12, 20):  # T5's two stacks cost twice: one length
            tokens = torch.randint(1, 128, (2, length))
            valid = torch.ones(2, length, dtype=torch.long)
            valid[1, -3:] = 0
            torch._dynamo.reset()
            rolled = _step(model, torch.compile(model, backend="tpucompile", options={"roll_layers": True}),
                           tokens, valid)
            eager = _step(model, model, tokens, valid)
            compared = [rolled]
            if length == 12:  # against the unrolled stacks at one length: a second adds compile time, not a path
                torch._dynamo.reset()
                unrolled = _step(model, torch.compile(model, backend="tpucompile", options={"roll_layers": False}),
                                 tokens, valid)
                torch.testing.assert_close(rolled[0], unrolled[0], rtol=1e-6, atol=1e-6)
                compared.append(unrolled)
            for got in compared:
                torch.testing.assert_close(got[0], eager[0], rtol=2e-5, atol=2e-5)
                assert got[1].keys() == eager[1].keys()
                for key in eager[1]:
                    torch.testing.assert_close(got[1][key], eager[1][key], rtol=1e-4, atol=1e-5, msg=key)
    finally:
        remove()
    roles = {event.rsplit("(", 1)[-1] for event in loops}
    assert {"forward)", "backward)"} <= roles, f"{name}: no rolled loop in both programs ({loops})"


@pytest.mark.parametrize(("name", "budget"), [("llama", 0.0), ("gpt2", 0.5)])
def test_rolled_stacks_recompute_inside_the_loop_like_eager(name, budget, cache_dir):
    """An activation budget below 1 applies inside the loop's body: each layer's backward recomputes its own
    values in the reverse loop (the backward runs that loop alone), and every gradient matches eager."""
    torch.manual_seed(0)
    model = MODELS[name]()
    model.config._attn_implementation = "sdpa"
    tokens = torch.randint(1, 128, (2, 16))
    valid = torch.ones(2, 16, dtype=torch.long)
    valid[1, -3:] = 0
    events: list = []
    remove = driver.add_observer(events.append)
    try:
        torch._dynamo.reset()
        got = _step(model, torch.compile(model, backend="tpucompile",
                                         options={"roll_layers": True, "activation_memory_budget": budget}),
                    tokens, valid)
    finally:
        remove()
    eager = _step(model, model, tokens, valid)
    torch.testing.assert_close(got[0], eager[0], rtol=2e-5, atol=2e-5)
    assert got[1].keys() == eager[1].keys()
    for key in eager[1]:
        torch.testing.assert_close(got[1][key], eager[1][key], rtol=1e-4, atol=1e-5, msg=key)
    loops = {role: sum(1 for e in events if e.name.endswith(f"({role})") and e.graph is not None
                       for n in e.graph.graph.nodes if is_loop(n)) for role in ("forward", "backward")}
    assert loops == {"forward": 1, "backward": 1}, loops
