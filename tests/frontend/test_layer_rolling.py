"""What the layer roller rolls, what it leaves unrolled and why, and that a rolled graph still computes what the
model does (run by PyTorch itself, before AOTAutograd: the rewrite alone, without our lowering)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tpucompile.frontend.layer_rolling import ROLLING_KEY, roll_repeated_layers


class Block(nn.Module):
    def __init__(self, width: int = 16, extra: bool = False, in_place: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.extra, self.in_place, self.dropout = extra, in_place, dropout

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(self.norm(x))) * scale
        if self.extra:
            h = h.relu()
        if self.in_place:
            h.mul_(2.0)
        h = torch.nn.functional.dropout(h, self.dropout, self.training)
        return x + self.down(h)


class Stack(nn.Module):
    def __init__(self, blocks: list[Block], keep_first: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.keep_first = keep_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(x.shape[-1] * 2) * 0.5
        kept = []
        for block in self.blocks:
            x = block(x, scale)
            kept.append(x)
        return x.sum() + (kept[0].mean() if self.keep_first else 0)


def _rolled(model: nn.Module, x: torch.Tensor) -> tuple[list[str], torch.Tensor, dict[str, torch.Tensor]]:
    """The roller's notes on the model's graph, and the loss and gradients of the rolled graph run by PyTorch."""
    notes: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        notes.extend(roll_repeated_layers(gm).notes)
        assert gm.meta[ROLLING_KEY] == notes
        loops = sum(n.target is torch.ops.higher_order.scan for n in gm.graph.nodes)
        assert loops == sum(n.startswith("rolled") for n in notes), (loops, notes)  # a loop per run rolled
        return gm.forward

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, backend=backend)(x)
    loss.backward()
    return notes, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _eager(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_same(model: nn.Module, x: torch.Tensor) -> list[str]:
    notes, loss, grads = _rolled(model, x)
    eager_loss, eager_grads = _eager(model, x)
    torch.testing.assert_close(loss, eager_loss)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    return notes


@pytest.fixture
def x() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 5, 16)


def test_identical_blocks_roll_into_one_loop(x):
    notes = _check_same(Stack([Block() for _ in range(4)]), x)
    assert len(notes) == 1 and notes[0].startswith("rolled") and "[0:4]: 4 layers" in notes[0], notes
    assert "1 shared" in notes[0], notes  # the scale every block reads


def test_a_differing_block_splits_the_run(x):
    blocks = [Block(), Block(), Block(extra=True), Block(), Block(), Block()]
    notes = _check_same(Stack(blocks), x)
    assert any("[0:2]: 2 layers" in n for n in notes if n.startswith("rolled")), notes
    assert any("[3:6]: 3 layers" in n for n in notes if n.startswith("rolled")), notes
    assert any(n.startswith("unrolled") and "[2:3]" in n for n in notes), notes


@pytest.mark.parametrize("block, reason", [
    (lambda: Block(in_place=True), "in place"),
    (lambda: Block(dropout=0.3), "random"),
])
def test_blocks_a_loop_cannot_repeat_stay_unrolled(x, block, reason):
    model = Stack([block() for _ in range(3)])
    notes = _check_same(model, x) if reason != "random" else _rolled(model, x)[0]  # dropout draws anew
    assert notes and all(n.startswith("unrolled") for n in notes), notes
    assert reason in notes[0], notes


def test_values_read_after_the_run_come_back_per_layer(x):
    notes = _check_same(Stack([Block() for _ in range(3)], keep_first=True), x)
    assert notes[0].startswith("rolled") and "1 stacked outputs" in notes[0], notes


def test_a_value_without_a_gradient_leaving_each_layer_keeps_the_run_unrolled():
    """Hugging Face Mistral's sliding-window cache keeps an integer length per layer: PyTorch's scan cannot
    differentiate a loop with such an output."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                        sliding_window=4)
    config._attn_implementation = "sdpa"
    model = transformers.MistralForCausalLM(config)
    notes: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        notes.extend(roll_repeated_layers(gm).notes)
        return gm.forward

    tokens = torch.randint(0, 64, (1, 6))
    torch.compile(model, backend=backend)(input_ids=tokens).logits.sum().backward()
    assert notes and notes[0].startswith("unrolled") and "without a gradient" in notes[0], notes


class OtherBlock(Block):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))) * scale)


class TwoStacks(nn.Module):
    """Two module lists, the second reading the first's last layer directly."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.ModuleList([Block() for _ in range(3)])
        self.second = nn.ModuleList([OtherBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(x.shape[-1] * 2) * 0.5
        for block in [*self.first, *self.second]:
            x = block(x, scale)
        return x.sum()


def test_a_run_that_reads_a_rolled_run_directly_rolls_too(x):
    notes = _check_same(TwoStacks(), x)
    assert [n.split(": ")[0] for n in notes] == ["rolled L['self'].first[0:3]", "rolled L['self'].second[0:3]"], notes


def test_a_rewrite_that_fails_half_way_leaves_the_graph_as_it_was(x, monkeypatch):
    from tpucompile.frontend import layer_rolling

    rewrite, calls = layer_rolling._rewrite, []

    def second_fails(gm, plan, name):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("a rewrite this test breaks")
        return rewrite(gm, plan, name)

    monkeypatch.setattr(layer_rolling, "_rewrite", second_fails)
    notes = _check_same(TwoStacks(), x)
    assert len(calls) == 2 and notes == ["unrolled: rolling failed (RuntimeError: a rewrite this test breaks)"], notes
