"""The gradient of a bf16/f16 embedding table summed per token id (option ``compact_embedding_grad``): the
values of PyTorch's f32 decomposition, without its f32 copy of the table, in compiled training of a plain
embedding and of Hugging Face's GPT-2 (a tied head, a position table), against the switch off and eager."""

from __future__ import annotations

import pytest
import torch

from tests.cached_runs import fresh_start
from tpucompile.frontend.decompositions import _TORCH_EMBEDDING_BACKWARD, embedding_dense_backward

ONE_BF16_STEP = 2.0**-7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_the_per_id_sum_equals_pytorchs_decomposition(dtype, padding_idx):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (4, 300), generator=generator)
    ids[0, :50] = 3  # one id many times: an f32 sum of 50+ rows, rounded once
    ids[1, :7] = 39
    grad = torch.randn(4, 300, 16, generator=generator).to(dtype)
    ours = embedding_dense_backward(grad, ids, 50, padding_idx, False)
    theirs = _TORCH_EMBEDDING_BACKWARD(grad, ids, 50, padding_idx, False)
    assert ours.dtype == theirs.dtype == dtype and ours.shape == theirs.shape == (50, 16)
    torch.testing.assert_close(ours, theirs, rtol=ONE_BF16_STEP, atol=1e-6)
    assert ours[40:].eq(0).all(), "ids never used get zeros"
    if padding_idx >= 0:
        assert ours[padding_idx].eq(0).all(), "the padding row gets no gradient"
    # against an f32 sum the narrow result is one rounding away; eager's bf16 kernel sums in bf16
    exact = torch.zeros(50, 16).index_add_(0, ids.reshape(-1), grad.reshape(-1, 16).float())
    if padding_idx >= 0:
        exact[padding_idx] = 0
    torch.testing.assert_close(ours.float(), exact.to(dtype).float(), rtol=ONE_BF16_STEP, atol=1e-6)


def test_scale_grad_by_freq_and_empty_ids_take_or_match_pytorchs_form():
    grad = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 1, 2, 0, 1], [4, 4, 4, 2, 0]])
    torch.testing.assert_close(embedding_dense_backward(grad, ids, 6, -1, True),
                               _TORCH_EMBEDDING_BACKWARD(grad, ids, 6, -1, True))
    empty = embedding_dense_backward(torch.zeros(0, 8, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.long),
                                     6, -1, False)
    assert empty.shape == (6, 8) and empty.eq(0).all()


class _Tagger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 32, padding_idx=0)
        self.out = torch.nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(ids))).float().square().mean()


def _grads(model: torch.nn.Module, args: tuple, compact: bool | None) -> tuple[dict[str, torch.Tensor], str]:
    """The parameter gradients of one training step (eager with ``compact`` None), and the StableHLO of its
    compiled programs."""
    model.zero_grad()
    if compact is None:
        model(*args).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}, ""
    with fresh_start() as events:
        options = {"compact_embedding_grad": compact, "cache_mode": "off"}
        torch.compile(model, backend="tpucompile", options=options)(*args).backward()
    text = "".join(e.program.text(debug_info=False) for e in events)
    return {k: p.grad.clone() for k, p in model.named_parameters()}, text


def _close_in_bf16(actual: torch.Tensor, expected: torch.Tensor, scale: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=4 * ONE_BF16_STEP, atol=4 * ONE_BF16_STEP * scale)


def test_a_compiled_bf16_embedding_trains_alike_with_the_switch_on_and_off():
    torch.manual_seed(0)
    model = _Tagger().to(torch.bfloat16)
    ids = torch.randint(0, 300, (6, 200))
    ids[:, :30] = 7  # a frequent token
    ids[:, 30:40] = 0  # padding
    compact, compact_program = _grads(model, (ids,), True)
    plain, plain_program = _grads(model, (ids,), False)
    model32 = _Tagger()
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    reference, _ = _grads(model32, (ids,), None)
    assert "stablehlo.sort" in compact_program and "stablehlo.sort" not in plain_program
    assert "300x32xf32" not in compact_program and "300x32xf32" in plain_program, "no f32 copy of the table"
    for name in compact:
        scale = reference[name].abs().max().item()
        _close_in_bf16(compact[name], plain[name], scale)
        _close_in_bf16(compact[name], reference[name], scale)
    assert compact["embed.weight"][0].eq(0).all()
    assert compact["embed.weight"][7].abs().max() > 0


def test_hugging_face_gpt2_trains_alike_with_the_switch_on_and_off():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    ids = torch.randint(0, 512, (4, 64))
    ids[:, ::3] = 11

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, labels=ids).loss

    wrapped = Loss()
    compact, program = _grads(wrapped, (ids,), True)
    plain, _ = _grads(wrapped, (ids,), False)
    assert "stablehlo.sort" in program
    for name in ("model.transformer.wte.weight", "model.transformer.wpe.weight"):
        scale = plain[name].float().abs().max().item()
        _close_in_bf16(compact[name], plain[name], scale)
