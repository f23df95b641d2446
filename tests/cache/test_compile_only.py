"""Compile-only runs: every graph of a step compiled for a TPU target and stored, nothing compiled for or run
on this machine, outputs with the right shapes and dtypes (``meta`` for a model that holds no weights)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tpucompile import driver
from tpucompile.cache import PersistentCache
from tpucompile.config import Options
from tpucompile.errors import OptionsError

TARGET = "tpu:v5e:1x1"
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu is not installed (pip install "tpucompile[tpu]")')


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))


def _events() -> tuple[list, callable]:
    events: list = []
    return events, driver.add_observer(events.append)


@needs_libtpu
def test_a_meta_model_trains_through_compile_only_and_fills_the_cache(tmp_path):
    """A model built on the meta device: forward, backward and an optimiser step all compile for the target
    (stored under the target's keys), nothing is compiled for this machine, and gradients are meta tensors
    shaped like the parameters."""
    with torch.device("meta"):
        net = _Net()
    x, labels = torch.randn(8, 16, device="meta"), torch.randint(0, 10, (8,), device="meta")
    options = {"targets": [TARGET], "cache_dir": str(tmp_path)}
    events, remove = _events()
    try:
        out = torch.compile(net, backend="tpucompile", options=options)(x)
        assert out.is_meta and out.shape == (8, 10) and out.dtype == torch.float32
        F.cross_entropy(out, labels).backward()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        torch.compile(optimizer.step, backend="tpucompile", options=options)()
    finally:
        remove()
    for name, parameter in net.named_parameters():
        assert parameter.grad is not None and parameter.grad.is_meta and parameter.grad.shape == parameter.shape, name
    assert events and all(e.target == TARGET and e.error is None for e in events), [(e.name, e.target) for e in events]
    roles = {e.name.rsplit("(", 1)[-1].rstrip(")") for e in events}
    assert {"forward", "backward"} <= roles and len(events) >= 3, roles
    stored = PersistentCache(tmp_path)
    assert all(stored.get(e.key) is not None for e in events), "an executable for the target was not stored"
    assert all(e.report["memory"]["peak"] > 0 and e.report["flops"] > 0 for e in events)


@needs_libtpu
def test_compile_only_on_real_tensors_gives_outputs_of_the_right_shape_on_their_device():
    net = _Net()
    events, remove = _events()
    try:
        options = {"targets": [TARGET], "compile_only": True, "cache_mode": "off"}
        out = torch.compile(net, backend="tpucompile", options=options)(torch.randn(4, 16))
    finally:
        remove()
    assert out.device.type == "cpu" and out.shape == (4, 10)
    assert [e.target for e in events] == [TARGET]


def test_meta_inputs_without_targets_and_compile_only_without_targets_are_refused():
    with torch.device("meta"):
        net = _Net()
    with pytest.raises(Exception, match=r"is a meta tensor, which holds no values to run on.*targets"):
        torch.compile(net, backend="tpucompile")(torch.randn(2, 16, device="meta"))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="compile_only compiles for targets only"):
        torch.compile(_Net(), backend="tpucompile", options={"compile_only": True})(torch.randn(2, 16))


def test_compile_only_option_and_environment_variable():
    assert Options.from_sources(environ={"TPUCOMPILE_COMPILE_ONLY": "1"}).compile_only is True
    assert Options().compile_only is False
    with pytest.raises(OptionsError, match="must be a bool"):
        Options.from_sources({"compile_only": "yes"})
