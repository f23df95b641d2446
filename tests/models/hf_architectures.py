"""Hugging Face architectures, random-initialised from small configs, through one forward and backward each,
against eager PyTorch: a sweep beside the test suite (too long for it), for the models the suite does not run.

    python tests/models/hf_architectures.py [--models falcon_alibi,deberta_v2] [--train]

Per model: the loss (the model's own, else the mean square of its first output) to 1e-4, and every parameter's
gradient to 2e-4, with a padding mask on one row of the text models. Eval mode by default: dropout off
whatever a module read from its config at construction (``--train`` for training mode, where a module that
kept a dropout probability of its own is random). Eager runs attention on PyTorch's math backend: its CPU
kernel's backward differs from its own forward on rows masked by the dtype's most negative value (Falcon's
ALiBi mask with padding), where the compiled model gives the math form's gradient
(``tests/frontend/test_fused_attention.py``). Prints one line per model, ``ok`` (with the graphs compiled)
or ``FAIL`` with the reason.
"""

from __future__ import annotations

import argparse
import copy
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers as hf
from torch.nn.attention import SDPBackend, sdpa_kernel

from tpucompile import driver

_TEXT = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=64)
_SEQ2SEQ = dict(vocab_size=96, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64)
_VISION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, image_size=32,
               patch_size=8)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model(model_class: str, config_class: str, **config: Any) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(hf, model_class)(getattr(hf, config_class)(**config))


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "phi3": _model("Phi3ForCausalLM", "Phi3Config", **_TEXT, num_key_value_heads=2, **_IDS),
    "phi": _model("PhiForCausalLM", "PhiConfig", **_TEXT, partial_rotary_factor=0.5),
    "gpt_neox": _model("GPTNeoXForCausalLM", "GPTNeoXConfig", **_TEXT, rotary_pct=0.25),
    "falcon_alibi": _model("FalconForCausalLM", "FalconConfig", **_TEXT, alibi=True, multi_query=True,
                           new_decoder_architecture=False),
    "falcon": _model("FalconForCausalLM", "FalconConfig", **_TEXT, new_decoder_architecture=True, num_kv_heads=2),
    "bloom": _model("BloomForCausalLM", "BloomConfig", vocab_size=96, hidden_size=64, n_layer=2, n_head=4),
    "opt": _model("OPTForCausalLM", "OPTConfig", **{**_TEXT, "intermediate_size": None}, ffn_dim=96,
                  word_embed_proj_dim=64),
    "gptj": _model("GPTJForCausalLM", "GPTJConfig", vocab_size=96, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                   n_positions=64),
    "gemma2": _model("Gemma2ForCausalLM", "Gemma2Config", **_TEXT, num_key_value_heads=2, head_dim=16,
                     sliding_window=8),
    "mixtral": _model("MixtralForCausalLM", "MixtralConfig", **_TEXT, num_key_value_heads=2, num_local_experts=4,
                      num_experts_per_tok=2),
    "qwen2_moe": _model("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_TEXT, num_key_value_heads=2, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "stablelm": _model("StableLmForCausalLM", "StableLmConfig", **_TEXT, num_key_value_heads=2),
    "starcoder2": _model("Starcoder2ForCausalLM", "Starcoder2Config", **_TEXT, num_key_value_heads=2),
    "olmo2": _model("Olmo2ForCausalLM", "Olmo2Config", **_TEXT, num_key_value_heads=2),
    "cohere": _model("CohereForCausalLM", "CohereConfig", **_TEXT, num_key_value_heads=2),
    "granite": _model("GraniteForCausalLM", "GraniteConfig", **_TEXT, num_key_value_heads=2),
    "gpt_bigcode": _model("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=96, n_embd=64, n_layer=2,
                          n_head=4, n_positions=64, multi_query=True),
    "deepseek_v3": _model("DeepseekV3ForCausalLM", "DeepseekV3Config", **_TEXT, num_key_value_heads=4,
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                          qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
    "roberta": _model("RobertaForMaskedLM", "RobertaConfig", **{**_TEXT, "max_position_embeddings": 80}),
    "distilbert": _model("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=96, dim=64, n_layers=2,
                         n_heads=4, hidden_dim=96, max_position_embeddings=64),
    "deberta_v2": _model("DebertaV2ForMaskedLM", "DebertaV2Config", **_TEXT, relative_attention=True,
                         pos_att_type=["p2c", "c2p"], position_buckets=16),
    "albert": _model("AlbertForMaskedLM", "AlbertConfig", **_TEXT, embedding_size=32),
    "electra": _model("ElectraForMaskedLM", "ElectraConfig", **_TEXT, embedding_size=32),
    "modernbert": _model("ModernBertForMaskedLM", "ModernBertConfig", **{**_TEXT, "num_hidden_layers": 3},
                         local_attention=8, global_attn_every_n_layers=2, **_IDS, cls_token_id=1, sep_token_id=2),
    "mpnet": _model("MPNetForMaskedLM", "MPNetConfig", **{**_TEXT, "max_position_embeddings": 80}),
    "bart": _model("BartForConditionalGeneration", "BartConfig", **_SEQ2SEQ),
    "pegasus": _model("PegasusForConditionalGeneration", "PegasusConfig", **_SEQ2SEQ),
    "long_t5": _model("LongT5ForConditionalGeneration", "LongT5Config", vocab_size=96, d_model=64, d_kv=16, d_ff=96,
                      num_layers=2, num_heads=4, local_radius=4, encoder_attention_type="transient-global",
                      global_block_size=4, decoder_start_token_id=0, pad_token_id=0),
    "whisper": _model("WhisperForConditionalGeneration", "WhisperConfig", **_SEQ2SEQ, num_mel_bins=16,
                      max_source_positions=16, max_target_positions=32, **_IDS, decoder_start_token_id=1),
    "wav2vec2": _model("Wav2Vec2ForCTC", "Wav2Vec2Config", **{**_TEXT, "vocab_size": 32}, conv_dim=(16, 16),
                       conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                       num_conv_pos_embedding_groups=4),
    "vit": _model("ViTForImageClassification", "ViTConfig", **_VISION, num_labels=5),
    "swin": _model("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=4, embed_dim=16,
                   depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=5),
    "convnext": _model("ConvNextForImageClassification", "ConvNextConfig", num_stages=2, hidden_sizes=[16, 32],
                       depths=[1, 1], num_labels=5, image_size=32),
    "beit": _model("BeitForImageClassification", "BeitConfig", **_VISION, num_labels=5,
                   use_relative_position_bias=True),
    "segformer": _model("SegformerForSemanticSegmentation", "SegformerConfig", num_encoder_blocks=2, depths=[1, 1],
                        sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                        decoder_hidden_size=32, num_labels=5),
    "dinov2": _model("Dinov2Model", "Dinov2Config", **{k: v for k, v in _VISION.items() if k != "intermediate_size"}),
    "clip": _model("CLIPModel", "CLIPConfig", text_config={**_TEXT, "max_position_embeddings": 32},
                   vision_config=_VISION),
    "mobilevit": _model("MobileViTForImageClassification", "MobileViTConfig", image_size=32,
                        hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 8, 16, 16, 32, 48, 64], num_labels=5),
}
"""Decoders (rotary in part or whole, ALiBi, multi-query, soft-capping, sliding windows, mixtures of experts,
latent attention), encoders (relative attention, local and global layers), encoder-decoders (transient-global
attention, audio features), vision and audio models."""

_IMAGES = {"vit", "swin", "convnext", "beit", "dinov2", "mobilevit", "segformer"}


def inputs(name: str, generator: torch.Generator) -> dict[str, Any]:
    """One batch for model ``name``: images, audio, or two rows of tokens with the second's first five padded."""
    if name in _IMAGES:
        batch = {"pixel_values": torch.randn(2, 3, 32, 32, generator=generator)}
        if name not in ("dinov2", "segformer"):
            batch["labels"] = torch.randint(0, 5, (2,), generator=generator)
        return batch
    if name == "clip":
        return {"input_ids": torch.randint(3, 96, (2, 12), generator=generator),
                "pixel_values": torch.randn(2, 3, 32, 32, generator=generator), "return_loss": True}
    if name == "whisper":
        return {"input_features": torch.randn(2, 16, 32, generator=generator),
                "labels": torch.randint(3, 96, (2, 9), generator=generator)}
    if name == "wav2vec2":
        return {"input_values": torch.randn(2, 800, generator=generator),
                "labels": torch.randint(1, 32, (2, 5), generator=generator)}
    ids = torch.randint(3, 96, (2, 24), generator=generator)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def _scalar(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    first = next(value for value in output.values() if isinstance(value, torch.Tensor))
    return first.float().pow(2).mean()


def check(name: str, train: bool) -> str:
    """One model's forward and backward, compiled against eager; raises where they differ. Says how long the
    compiled call took and how many graphs tpucompile compiled (few where Dynamo broke the model into pieces
    that run in eager PyTorch)."""
    torch.manual_seed(0)
    model = MODELS[name]().train(train)
    twin = copy.deepcopy(model)
    batch = inputs(name, torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH):
        expected = _scalar(model(**batch))
    expected.backward()
    compiled_before = driver.graphs_compiled()
    start = time.perf_counter()
    got = _scalar(torch.compile(twin, backend="tpucompile")(**batch))
    got.backward()
    seconds = time.perf_counter() - start
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for (parameter, mine), theirs in zip(twin.named_parameters(), model.parameters(), strict=True):
        if theirs.grad is None:
            assert mine.grad is None or not mine.grad.any(), f"{parameter}: a gradient where eager has none"
            continue
        assert mine.grad is not None, f"{parameter}: no gradient"
        torch.testing.assert_close(mine.grad, theirs.grad, atol=2e-4, rtol=2e-4,
                                   msg=lambda message, p=parameter: f"{p}: {message}")
    return f"{seconds:.1f} s, {driver.graphs_compiled() - compiled_before} graphs compiled"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names (default: all)")
    parser.add_argument("--train", action="store_true", help="training mode instead of eval mode")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    failed = 0
    for name in args.models.split(","):
        torch._dynamo.reset()
        try:
            print(f"{name:14} ok    {check(name, args.train)}", flush=True)
        except Exception as error:  # every model's outcome is reported, and the sweep goes on
            failed += 1
            reason = traceback.format_exception_only(type(error), error)[-1].strip().splitlines()[0]
            print(f"{name:14} FAIL  {reason[:300]}", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
