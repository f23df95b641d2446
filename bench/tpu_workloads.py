"""The TPU benchmark's workloads: every example model at a size people train on a TPU chip, its batch, its
training loss, and its hand-written JAX reference (``bench/jax_reference/``) called on the same shapes.

A workload is built for one dtype: ``float32``, or ``bfloat16`` with the model cast by ``.to(torch.bfloat16)``
and its floating-point inputs cast alike (integer inputs stay as they are), on both sides.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_BENCH.parent / "examples"))
sys.path.insert(0, str(_BENCH))


@dataclasses.dataclass
class TpuWorkload:
    name: str
    model: nn.Module
    config: Any
    """The example's own config, which the JAX reference reads too."""
    inference_inputs: tuple
    """Arguments of the model's inference call (eval mode)."""
    training_inputs: tuple
    """What the training loss reads: the inference arguments and the targets."""
    loss: Callable[..., torch.Tensor]
    """The training loss: ``loss(model, *training_inputs)`` for the (compiled) model."""
    reference: ModuleType
    """The hand-written JAX model: ``forward(params, inference_inputs, config)``, ``loss(params,
    training_inputs, config)``."""
    reference_loss_has_buffers: bool = False
    """The reference's loss returns ``(loss, updated buffers)`` (models with BatchNorm, and DLRM's empty dict)."""
    model_flops_note: str = ""


def build(name: str, dtype: torch.dtype, small: bool = False) -> TpuWorkload:
    """The workload ``name`` in ``dtype``; ``small`` (GPT only): a quarter of its width, 2 blocks, 2 x 128 tokens,
    which compiles in seconds (the test suite's regression guard)."""
    torch.manual_seed(0)
    workload = _BUILDERS[name](small) if small else _BUILDERS[name]()
    workload.model.to(dtype)
    workload.inference_inputs = _cast(workload.inference_inputs, dtype)
    workload.training_inputs = _cast(workload.training_inputs, dtype)
    return workload


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _reference(name: str) -> ModuleType:
    return importlib.import_module(f"jax_reference.{name}")


def _tokens(vocab: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, vocab, (batch, length), generator=generator),
            torch.randint(0, vocab, (batch, length), generator=generator))


def gpt(small: bool = False) -> TpuWorkload:
    """GPT-2-style: 4 pre-LN blocks of width 1024 (8 heads), GELU MLP, tied head, 8 x 512 tokens."""
    from mingpt import GPT, GPTConfig

    if small:
        config = GPTConfig(vocab_size=4096, block_size=128, n_layer=2, n_head=4, n_embd=256)
        idx, targets = _tokens(config.vocab_size, 2, 128)
    else:
        config = GPTConfig(vocab_size=32768, block_size=512, n_layer=4, n_head=8, n_embd=1024)
        idx, targets = _tokens(config.vocab_size, 8, 512)
    return TpuWorkload("gpt", GPT(config), config, (idx,), (idx, targets), lambda net, idx, targets: net(idx, targets),
                       _reference("mingpt"))


def llama() -> TpuWorkload:
    """Llama-style: 4 blocks of width 1024, 8 query and 4 key/value heads, SwiGLU 2816, RoPE, 8 x 512 tokens."""
    from llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=32768, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=2816,
                         max_seq_len=512)
    tokens, targets = _tokens(config.vocab_size, 8, 512)
    return TpuWorkload("llama", Llama(config), config, (tokens,), (tokens, targets),
                       lambda net, tokens, targets: net(tokens, targets=targets), _reference("llama"))


def qwen() -> TpuWorkload:
    """Qwen3-MoE-style: 4 blocks of width 1024, 8/4 heads of 128, 8 experts of 768 (top 2), 8 x 512 tokens."""
    from qwen import Qwen, QwenConfig

    config = QwenConfig(vocab_size=32768, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=128,
                        n_experts=8, top_k=2, expert_hidden_dim=768, max_seq_len=512)
    tokens, targets = _tokens(config.vocab_size, 8, 512)
    return TpuWorkload("qwen", Qwen(config), config, (tokens,), (tokens, targets),
                       lambda net, tokens, targets: net(tokens, targets), _reference("qwen"))


def resnet() -> TpuWorkload:
    """ResNet-18's layout on 32 images of 224 x 224, 1000 classes."""
    from resnet import RESNET_18, ResNet

    config = dataclasses.replace(RESNET_18, image_size=224, num_classes=1000)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(32, 3, 224, 224, generator=generator)
    labels = torch.randint(0, 1000, (32,), generator=generator)
    return TpuWorkload("resnet", ResNet(config), config, (images,), (images, labels),
                       lambda net, images, labels: F.cross_entropy(net(images), labels), _reference("resnet"), True)


def unet() -> TpuWorkload:
    """The example's UNet at base width 32 on 8 images of 256 x 256, 4 classes per pixel."""
    from unet import UNet, UNetConfig

    config = UNetConfig(image_size=256, base_width=32)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(8, 3, 256, 256, generator=generator)
    masks = torch.randint(0, config.num_classes, (8, 256, 256), generator=generator)
    return TpuWorkload("unet", UNet(config), config, (images,), (images, masks),
                       lambda net, images, masks: F.cross_entropy(net(images), masks), _reference("unet"), True)


def dlrm() -> TpuWorkload:
    """DLRM with 8 tables of 100k rows of width 64 and MLPs of 512/256, on a batch of 2048."""
    from dlrm import DLRM, DLRMConfig, make_batch

    config = DLRMConfig(table_sizes=(100_000,) * 8, embedding_dim=64, bottom_mlp=(512, 256), top_mlp=(512, 256),
                        max_bag_size=8)
    dense, indices, offsets, labels = make_batch(config, 2048, torch.Generator().manual_seed(1))
    return TpuWorkload("dlrm", DLRM(config), config, (dense, indices, offsets), (dense, indices, offsets, labels),
                       lambda net, dense, indices, offsets, labels: F.binary_cross_entropy_with_logits(
                           net(dense, indices, offsets), labels),
                       _reference("dlrm"), True)


def _hugging_face(name: str, model_class: str, config: Any, length: int = 1024,
                  reference: str = "hf_decoder") -> TpuWorkload:
    """A transformers decoder at 4 x ``length`` tokens with a padding mask (all ones, as a tokenizer gives for
    full rows), which transformers turns into a boolean mask inside the graph; the reference
    (``jax_reference/hf_decoder.py``, ``hf_gpt2.py``) calls the splash kernel with the same mask."""
    import transformers

    config._attn_implementation = "sdpa"
    tokens, targets = _tokens(config.vocab_size, 4, length)
    valid = torch.ones(4, length, dtype=torch.long)

    def loss(net, tokens, valid, targets):
        logits = net(input_ids=tokens, attention_mask=valid).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    model = getattr(transformers, model_class)(config)
    return TpuWorkload(name, model, config, (tokens, valid), (tokens, valid, targets), loss, _reference(reference))


_HF_SIZE = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, use_cache=False)
"""4 layers of width 1024, 8 query / 2 key-value heads of 128, SwiGLU 2816."""


def hf_llama() -> TpuWorkload:
    """Hugging Face's own ``LlamaForCausalLM`` (causal mask and padding)."""
    import transformers

    return _hugging_face("hf_llama", "LlamaForCausalLM", transformers.LlamaConfig(**_HF_SIZE))


def hf_mistral() -> TpuWorkload:
    """Hugging Face's ``MistralForCausalLM`` with a sliding window of 512 keys (of the 1024)."""
    import transformers

    return _hugging_face("hf_mistral", "MistralForCausalLM",
                         transformers.MistralConfig(**_HF_SIZE, sliding_window=512))


def hf_qwen3() -> TpuWorkload:
    """Hugging Face's ``Qwen3ForCausalLM`` (query and key RMSNorm per head)."""
    import transformers

    return _hugging_face("hf_qwen3", "Qwen3ForCausalLM", transformers.Qwen3Config(**_HF_SIZE, head_dim=128))


_GEMMA3_HEADS = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=256)
"""Gemma 3's heads of 256 (as its 4B model: 8 query and 4 key-value heads), five sliding-window layers to one
full one."""


def hf_gemma3() -> TpuWorkload:
    """Hugging Face's ``Gemma3ForCausalLM``: heads of 256, a window of 512 keys on five layers of six."""
    import transformers

    config = transformers.Gemma3TextConfig(**{**_HF_SIZE, **_GEMMA3_HEADS}, sliding_window=512)
    return _hugging_face("hf_gemma3", "Gemma3ForCausalLM", config, reference="hf_gemma3")


def hf_gpt2() -> TpuWorkload:
    """Hugging Face's ``GPT2LMHeadModel`` at the same width and depth, 16 heads of 64, dropout off."""
    import transformers

    return _hugging_face("hf_gpt2", "GPT2LMHeadModel", transformers.GPT2Config(**_GPT2_SIZE), reference="hf_gpt2")


_GPT2_SIZE = dict(vocab_size=32768, n_embd=1024, n_layer=4, n_head=16, n_positions=1024, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)

_HF_1B = dict(vocab_size=32768, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048, use_cache=False)
"""About 1B parameters (0.86B with a 32768-token vocabulary): 16 layers of width 2048, 16 query / 4 key-value
heads of 128, SwiGLU 5632; trained at 4 x 2048 tokens on one chip."""


def _hf_1b(name: str) -> Callable[[], TpuWorkload]:
    """The 1B-size form of an HF workload, at 4 x 2048 tokens."""

    def build() -> TpuWorkload:
        import transformers

        if name == "hf_gpt2":
            config = transformers.GPT2Config(**{**_GPT2_SIZE, "n_embd": 2048, "n_layer": 16, "n_head": 32,
                                                "n_positions": 2048})
            return _hugging_face("hf_gpt2_1b", "GPT2LMHeadModel", config, 2048, "hf_gpt2")
        if name == "hf_gemma3":
            config = transformers.Gemma3TextConfig(**{**_HF_1B, **_GEMMA3_HEADS}, sliding_window=512)
            return _hugging_face("hf_gemma3_1b", "Gemma3ForCausalLM", config, 2048, "hf_gemma3")
        config_class, model_class, extra = {
            "hf_llama": ("LlamaConfig", "LlamaForCausalLM", {}),
            "hf_mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 1024}),
            "hf_qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 128}),
        }[name]
        config = getattr(transformers, config_class)(**_HF_1B, **extra)
        return _hugging_face(f"{name}_1b", model_class, config, 2048)

    return build


_BUILDERS: dict[str, Callable[[], TpuWorkload]] = {
    "gpt": gpt, "llama": llama, "qwen": qwen, "resnet": resnet, "unet": unet, "dlrm": dlrm, "hf_llama": hf_llama,
    "hf_mistral": hf_mistral, "hf_qwen3": hf_qwen3, "hf_gemma3": hf_gemma3, "hf_gpt2": hf_gpt2,
    **{f"{name}_1b": _hf_1b(name) for name in ("hf_llama", "hf_mistral", "hf_qwen3", "hf_gemma3", "hf_gpt2")},
}
NAMES = tuple(_BUILDERS)
