"""A differential guard for training with the eager fallback: whichever op runs in eager PyTorch, forward or
backward, the gradients are eager's.

For each model, ATen ops its training graphs hold are made unlowerable in turn (as an op without a rule
would be): every backward op (the ones that read what a forward saved) and a spread of the others, up to
``OPS_PER_MODEL``. The step is compiled with the default ``fallback="eager"``, and the output and every input and
parameter gradient compared with eager. A backward op that ran eagerly on values its compiled forward did
not produce for it (a fused kernel's backward after a decomposed forward) shows here as wrong gradients or
as the compile's refusal, never as a pass. The same models compile whole with ``fallback="error"`` too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from tests.support import assert_close_tree
from tpucompile import driver, plan_replay
from tpucompile.lowering import graph as lowered_graph


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
        return self.head(x.mean((2, 3))).log_softmax(-1)


def _transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)


def _attention() -> nn.Module:
    return nn.MultiheadAttention(16, 2, batch_first=True)


OPS_PER_MODEL = 5

MODELS = {
    "transformer": (_transformer, lambda: (torch.randn(2, 6, 16),), {}),
    "multihead-attention": (_attention, lambda: (torch.randn(2, 6, 16),) * 3, {"need_weights": False}),
    "convnet": (_ConvNet, lambda: (torch.randn(2, 3, 8, 8),), {}),
}


def _step(model: nn.Module, call, inputs, kwargs) -> list[torch.Tensor]:
    model.zero_grad()
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = call(*leaves, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach(), *(x.grad for x in leaves), *(p.grad.clone() for p in model.parameters())]


def _training_ops(name: str, monkeypatch) -> list:
    """The ATen ops of the model's compiled forward and backward, in a fixed order."""
    seen: list = []
    original = driver.compile_graph

    def recording(gm, example_inputs, options, graph_name, targets=None):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function" and n.target not in seen)
        return original(gm, example_inputs, options, graph_name, targets)

    import tpucompile.backend as backend

    monkeypatch.setattr(backend, "compile_graph", recording)
    build, inputs, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = build()
    _step(model, torch.compile(model, backend="tpucompile", fullgraph=True, options={"fallback": "error"}),
          inputs(), kwargs)
    monkeypatch.setattr(backend, "compile_graph", original)
    ops = [op for op in seen if isinstance(op, torch._ops.OpOverload)]
    backward = [op for op in ops if "backward" in op.name()]
    others = [op for op in ops if op not in backward]
    spread = others[:: max(1, len(others) // max(1, OPS_PER_MODEL - len(backward)))]
    return (backward + spread)[:OPS_PER_MODEL]


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_are_eagers_whichever_op_falls_back(name, monkeypatch):
    monkeypatch.setattr(plan_replay, "compiled_from_plan", lambda *args, **kwargs: None)
    ops = _training_ops(name, monkeypatch)
    assert len(ops) == OPS_PER_MODEL, ops
    build, inputs, kwargs = MODELS[name]
    torch.manual_seed(1)
    data = inputs()
    torch.manual_seed(0)
    expected_model = build()
    expected = _step(expected_model, expected_model, data, kwargs)
    original_rule = lowered_graph._rule
    for op in ops:
        torch._dynamo.reset()
        monkeypatch.setattr(lowered_graph, "_rule",
                            lambda target, op=op: None if target is op else original_rule(target))
        torch.manual_seed(0)
        model = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            actual = _step(model, torch.compile(model, backend="tpucompile", options={"fallback": "eager"}), data,
                           kwargs)
        try:
            assert_close_tree(actual, expected, atol=2e-5, rtol=1e-4)
        except AssertionError as error:
            raise AssertionError(f"with {op} in eager PyTorch: {error}") from None
