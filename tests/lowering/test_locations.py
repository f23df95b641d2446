"""Every lowered op carries the user's file:line; keys ignore locations."""

from __future__ import annotations

import logging
import os
import re

import torch

from tests.support import compile_fn
from tpucompile import driver


def _capture(fn, *inputs):
    events = []
    remove = driver.add_observer(events.append)
    try:
        compile_fn(fn)(*inputs)
    finally:
        remove()
    return events


def model(x, w):
    y = x @ w  # LINE-MATMUL
    return torch.tanh(y) + 1  # LINE-TANH


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, 1):
            if marker in line and "def _line_of" not in line and "_line_of(" not in line:
                return number
    raise AssertionError(marker)


def test_ops_carry_user_source_locations():
    (event,) = _capture(model, torch.randn(2, 3), torch.randn(3, 4))
    text = event.program.text(debug_info=True)
    name = os.path.basename(__file__)
    locations = set(re.findall(r'loc\("([^"]+)":(\d+):\d+\)', text))
    files = {os.path.basename(f) for f, _ in locations}
    assert files == {name}, locations
    lines = {int(line) for _, line in locations}
    assert _line_of("LINE-MATMUL") in lines and _line_of("LINE-TANH") in lines
    assert re.search(r'loc\("aten\.tanh\.default"', text), text


def test_key_ignores_locations_and_program_verifies():
    (first,) = _capture(model, torch.randn(2, 3), torch.randn(3, 4))

    def same_model_other_lines(x, w):

        y = x @ w
        return torch.tanh(y) + 1

    (second,) = _capture(same_model_other_lines, torch.randn(2, 3), torch.randn(3, 4))
    assert first.program.text(debug_info=True) != second.program.text(debug_info=True)
    assert first.key == second.key
    assert second.cache_hit
    assert first.program.module.operation.verify()


def test_a_node_inside_torchs_own_modules_is_named_by_its_submodule(caplog, monkeypatch):
    """An ``nn.Sequential`` of torch's own modules leaves no user frame in Dynamo's stack traces: messages name
    the submodule instead (here the log line of a convolution over a changing image size, which compiles per
    size)."""
    monkeypatch.delenv("TPUCOMPILE_DYNAMIC_MODE", raising=False)
    caplog.set_level(logging.INFO, logger="tpucompile")
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU())
    compiled = torch.compile(net, backend="tpucompile")
    with torch.no_grad():
        for n in (10, 13):
            x = torch.randn(2, 3, n, n)
            torch._dynamo.mark_dynamic(x, 2)
            torch.testing.assert_close(compiled(x), net(x))
    logged = [r.getMessage() for r in caplog.records if "once per size" in r.getMessage()]
    assert logged and "aten.convolution" in logged[0], logged
    assert "in submodule 0 (Conv2d) (no source line recorded)" in logged[0], logged[0]
