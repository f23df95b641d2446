"""The hand-written JAX references of the transformer examples (``bench/jax_reference``: GPT, LLaMA, Qwen)
against the torch examples run eagerly: logits, the training loss and every parameter's gradient in float32,
and the logits and loss of the bfloat16 model.

Each model is built at its example's default config with the seed, batch and loss call of its workload in
``bench/models.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import sys
from collections.abc import Callable
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

from bench.jax_reference import llama as jax_llama
from bench.jax_reference import mingpt as jax_mingpt
from bench.jax_reference import qwen as jax_qwen

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

F32_TOL = 1e-4
"""Relative, and relative to each compared tensor's largest magnitude (see ``_assert_close``). The references
agree with torch to about 1e-6 of the scale (logits, losses and gradients, seeds 0-3)."""
BF16_LOSS_RTOL = 2e-2
"""Torch's bfloat16 loss is itself rounded to bfloat16 (steps of 1/32 near ln 256); the references' float32 loss
of the bfloat16 model agrees to within 0.7% (seeds 0-7)."""
BF16_LOGITS_TOL = 3e-2
"""Relative to the logits' largest magnitude: bfloat16 keeps 8 significant bits, and each side rounds in its own
places (the reference's statistics and softmaxes are in float32, torch's RMSNorm rounds after every op)."""
BF16_MOE_LOGITS_TOL = 1e-1
"""Relative error in norm of a mixture of experts' bfloat16 logits. With 4 experts, bfloat16 router probabilities
near 1/4 tie exactly for a few tokens a layer, and ``torch.topk`` (here: the higher expert index) and
``jax.lax.top_k`` (the lower) break ties differently; a token routed to another expert has other logits, and
later positions see it through attention. Torch's own bfloat16 logits differ from its float32 ones by about as
much (1-4% in norm, up to 15% of the scale on single tokens, over seeds 0-7; the reference's 1-6%)."""


@dataclasses.dataclass
class Case:
    model: nn.Module
    config: object
    tokens: torch.Tensor
    targets: torch.Tensor
    torch_loss: Callable[[nn.Module], torch.Tensor]
    """The workload's training loss for the given model."""
    reference: ModuleType
    moe: bool = False
    """A mixture of experts: its bfloat16 logits are compared in norm, not elementwise (``BF16_MOE_LOGITS_TOL``)."""


def _gpt() -> Case:
    from mingpt import GPT, GPTConfig

    config = GPTConfig()
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (4, config.block_size))
    targets = torch.randint(0, config.vocab_size, (4, config.block_size))
    return Case(model, config, idx, targets, lambda net: net(idx, targets), jax_mingpt)


def _llama() -> Case:
    from llama import Llama, LlamaConfig

    config = LlamaConfig()
    model = Llama(config)
    tokens = torch.randint(0, config.vocab_size, (4, 32))
    targets = torch.randint(0, config.vocab_size, (4, 32))
    return Case(model, config, tokens, targets, lambda net: net(tokens, targets=targets), jax_llama)


def _qwen() -> Case:
    from qwen import Qwen, QwenConfig

    config = QwenConfig()
    model = Qwen(config)
    tokens = torch.randint(0, config.vocab_size, (4, 32))
    targets = torch.randint(0, config.vocab_size, (4, 32))
    return Case(model, config, tokens, targets, lambda net: net(tokens, targets), jax_qwen, moe=True)


CASES: dict[str, Callable[[], Case]] = {"gpt": _gpt, "llama": _llama, "qwen": _qwen}


def _build(name: str) -> Case:
    torch.manual_seed(0)  # as bench.models.build
    return CASES[name]()


def _params(model: nn.Module, dtype: jnp.dtype) -> dict[str, jax.Array]:
    return {name: jnp.asarray(p.detach().float().numpy()).astype(dtype) for name, p in model.named_parameters()}


def _ints(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.numpy().astype(np.int32))


def _numpy(value: torch.Tensor | jax.Array) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().double().numpy()
    return np.asarray(value, dtype=np.float64)


def _assert_close(actual: jax.Array, expected: torch.Tensor, what: str, tol: float = F32_TOL) -> None:
    """Elementwise ``|actual - expected| <= tol * (|expected| + the tensor's largest magnitude)``: a near-zero
    element of a tensor is held to the tensor's scale, not its own."""
    actual_np, expected_np = _numpy(actual), _numpy(expected)
    assert actual_np.shape == expected_np.shape, (what, actual_np.shape, expected_np.shape)
    scale = float(np.abs(expected_np).max())
    np.testing.assert_allclose(actual_np, expected_np, rtol=tol, atol=tol * scale, err_msg=what)


def _jitted(case: Case, gradients: bool) -> Callable:
    """One compiled program per model and dtype (compiles dominate the test's time): the logits of the inference
    call and the training loss, with ``gradients`` as ``(loss, grads)`` from ``jax.value_and_grad``."""
    reference, config = case.reference, case.config

    def loss(params: dict[str, jax.Array], tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return reference.loss(params, (tokens, targets), config)

    def run(params: dict[str, jax.Array], tokens: jax.Array, targets: jax.Array) -> tuple:
        logits = reference.forward(params, (tokens,), config)
        return logits, (jax.value_and_grad(loss) if gradients else loss)(params, tokens, targets)

    return jax.jit(run)


@pytest.mark.parametrize("name", list(CASES))
def test_float32_matches_torch(name):
    """Logits, the loss and the gradient of every parameter."""
    case = _build(name)
    with torch.no_grad():
        expected_logits = case.model(case.tokens)
    expected_loss = case.torch_loss(case.model)
    expected_loss.backward()
    params = _params(case.model, jnp.float32)
    logits, (loss, grads) = _jitted(case, gradients=True)(params, _ints(case.tokens), _ints(case.targets))
    assert logits.dtype == jnp.float32
    _assert_close(logits, expected_logits, f"{name} logits")
    assert loss.shape == () and loss.dtype == jnp.float32
    _assert_close(loss, expected_loss, f"{name} loss")
    torch_params = dict(case.model.named_parameters())
    assert grads.keys() == torch_params.keys()
    for key, grad in grads.items():
        assert grad.dtype == jnp.float32
        _assert_close(grad, torch_params[key].grad, f"{name} gradient of {key}")


@pytest.mark.parametrize("name", list(CASES))
def test_bfloat16_matches_torch(name):
    """``model.to(torch.bfloat16)``: the logits (to bfloat16's precision) and the loss."""
    case = _build(name)
    model = copy.deepcopy(case.model).to(torch.bfloat16)
    with torch.no_grad():
        expected_logits = model(case.tokens)
        expected = case.torch_loss(model)
    params = _params(model, jnp.bfloat16)
    logits, loss = _jitted(case, gradients=False)(params, _ints(case.tokens), _ints(case.targets))
    assert logits.dtype == jnp.bfloat16
    if case.moe:
        difference = np.linalg.norm(_numpy(logits) - _numpy(expected_logits)) / np.linalg.norm(_numpy(expected_logits))
        assert difference <= BF16_MOE_LOGITS_TOL, f"{name} bfloat16 logits: relative error {difference:.3g} in norm"
    else:
        _assert_close(logits, expected_logits, f"{name} bfloat16 logits", tol=BF16_LOGITS_TOL)
    assert loss.shape == () and loss.dtype == jnp.float32
    np.testing.assert_allclose(_numpy(loss), _numpy(expected), rtol=BF16_LOSS_RTOL, err_msg=f"{name} loss")


_LLAMA_SIZE = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
HUGGING_FACE = {
    "llama": ("hf_decoder", "LlamaConfig", "LlamaForCausalLM", _LLAMA_SIZE),
    "mistral": ("hf_decoder", "MistralConfig", "MistralForCausalLM", {**_LLAMA_SIZE, "sliding_window": 40}),
    "qwen3": ("hf_decoder", "Qwen3Config", "Qwen3ForCausalLM", {**_LLAMA_SIZE, "head_dim": 32}),
    "gemma3": ("hf_gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_LLAMA_SIZE, "head_dim": 64, "query_pre_attn_scalar": 48, "sliding_window": 40,
        "layer_types": ["sliding_attention", "full_attention"]}),
    "gpt2": ("hf_gpt2", "GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=128, n_embd=128, n_layer=2, n_head=2, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
}


@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_hugging_face_decoder_reference_with_the_splash_kernel_matches_transformers(name, monkeypatch):
    """``bench/jax_reference/hf_decoder.py``, ``hf_gemma3.py`` and ``hf_gpt2.py`` (the splash kernel run by Pallas'
    interpreter) against transformers' model eagerly, at a small config with grouped-query heads (GPT-2: heads of
    64) and padding: the logits, the loss and every parameter's gradient (Mistral's and Gemma 3's windows shorter
    than the sequence; Gemma 3's query scale other than its head size's)."""
    import importlib

    import transformers

    from bench.jax_reference import hf_decoder

    monkeypatch.setattr(hf_decoder, "INTERPRET", True)
    module, config_class, model_class, sizes = HUGGING_FACE[name]
    reference = importlib.import_module(f"bench.jax_reference.{module}")
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**sizes, use_cache=False)
    config._attn_implementation = "sdpa"
    model = getattr(transformers, model_class)(config)
    generator = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, 128, (2, 128), generator=generator) for _ in range(2))
    valid = torch.ones(2, 128, dtype=torch.long)
    valid[1, 100:] = 0  # right padding: every row sees a key, as the reference (like JAX users) assumes
    logits = model(input_ids=tokens, attention_mask=valid).logits
    expected_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    expected_loss.backward()
    params = _params(model, jnp.float32)
    inputs = (_ints(tokens), _ints(valid))
    got_logits = jax.jit(lambda p, i: reference.forward(p, i, config))(params, inputs)
    loss, grads = jax.jit(jax.value_and_grad(lambda p, i: reference.loss(p, i, config)))(
        params, (*inputs, _ints(targets)))
    _assert_close(got_logits, logits.detach(), f"{name} logits")
    _assert_close(loss, expected_loss, f"{name} loss")
    for key, parameter in model.named_parameters():
        _assert_close(grads[key], parameter.grad, f"{name} gradient of {key}")


def test_the_example_references_kernel_attention_matches_their_math_form(monkeypatch):
    """``jax_reference/attention.py``: the splash kernel (Pallas' interpreter) against the math form, grouped
    query heads of 64 over 128 positions: outputs and the gradients of query, key and value."""
    from bench.jax_reference import attention, hf_decoder

    monkeypatch.setattr(hf_decoder, "INTERPRET", True)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 128, 4, 64))
    k, v = (jax.random.normal(key, (2, 128, 2, 64)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], (2, 128, 4 * 64))

    def run(kernel: bool):
        monkeypatch.setattr(attention, "KERNEL", kernel)
        return jax.value_and_grad(lambda *qkv: (attention.causal_attention(*qkv) * weights).sum(),
                                  argnums=(0, 1, 2))(q, k, v)

    (got, got_grads), (want, want_grads) = run(True), run(False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4)
    for name, a, b in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4, err_msg=name)
