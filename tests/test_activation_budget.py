"""The activation-memory budget: below 1 the forward saves less for the backward (which recomputes more), the
gradients stay equal to eager, and the saved bytes each backward reports show it."""

from __future__ import annotations

import pytest
import torch

from tpucompile import driver
from tpucompile.config import Options
from tpucompile.errors import OptionsError


class _Block(torch.nn.Module):
    """A pre-LN MLP block: enough products and elementwise ops for the partition to have a choice."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(), _Block(), _Block())


def _train(budget: float, x: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, int]]:
    torch._dynamo.reset()
    events: list = []
    remove = driver.add_observer(events.append)
    model = _model()
    try:
        compiled = torch.compile(model, backend="tpucompile",
                                 options={"activation_memory_budget": budget, "cache_mode": "off"})
        compiled(x).square().mean().backward()
    finally:
        remove()
    (saved,) = [e.saved_for_backward() for e in events if e.saved_for_backward() is not None]
    return [p.grad for p in model.parameters()], saved


def test_a_lower_budget_saves_fewer_activations_and_keeps_the_gradients():
    x = torch.randn(32, 64)
    reference = _model()
    reference(x).square().mean().backward()
    expected = [p.grad for p in reference.parameters()]
    grads, saved = {}, {}
    for budget in (1.0, 0.1):
        grads[budget], saved[budget] = _train(budget, x)
        for got, want in zip(grads[budget], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert saved[0.1]["activations"] < 0.5 * saved[1.0]["activations"], saved


def test_the_budget_is_checked():
    assert Options.from_sources({"activation_memory_budget": 0.5}).activation_memory_budget == 0.5
    assert Options.from_sources({}, {"TPUCOMPILE_ACTIVATION_MEMORY_BUDGET": "0.25"}).activation_memory_budget == 0.25
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(OptionsError, match="activation_memory_budget"):
            Options.from_sources({"activation_memory_budget": bad})
    with pytest.raises(OptionsError, match="not a number"):
        Options.from_sources({}, {"TPUCOMPILE_ACTIVATION_MEMORY_BUDGET": "half"})
