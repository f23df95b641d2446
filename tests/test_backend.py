"""The backend as a user meets it: registration, options, mutation write-back, dynamic shapes, errors."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import tpucompile
from tests.support import assert_close_tree, assert_compiles_like_eager, compile_fn
from tpucompile import driver


def test_backend_is_registered_without_import():
    script = textwrap.dedent(
        """
        import sys, torch
        assert "tpucompile" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        assert "tpucompile" not in sys.modules
        f = torch.compile(lambda x: x.sin() * 2, backend="tpucompile")
        x = torch.randn(5)
        torch.testing.assert_close(f(x), x.sin() * 2)
        assert "tpucompile.backend" in sys.modules
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_unknown_option_lists_valid_ones():
    f = compile_fn(lambda x: x + 1, no_such_option=True)
    with pytest.raises(Exception) as info:
        f(torch.randn(3))
    message = str(info.value)
    assert "unknown tpucompile option 'no_such_option'" in message
    for name in tpucompile.Options.field_names():
        assert name in message


def test_bad_option_type_is_refused():
    with pytest.raises(tpucompile.OptionsError, match="verify"):
        tpucompile.Options.from_sources({"verify": "yes"})


def test_environment_sets_options_and_explicit_options_win():
    env = {"TPUCOMPILE_EMBED_CONSTANT_LIMIT": "7", "TPUCOMPILE_VERIFY": "0"}
    assert tpucompile.Options.from_sources(None, env) == tpucompile.Options(embed_constant_limit=7, verify=False)
    assert tpucompile.Options.from_sources({"verify": True}, env).verify is True
    with pytest.raises(tpucompile.OptionsError, match="TPUCOMPILE_VERIFY"):
        tpucompile.Options.from_sources(None, {"TPUCOMPILE_VERIFY": "maybe"})


def test_narrow_products_takes_a_bool_or_auto_from_options_and_the_environment():
    assert tpucompile.Options().narrow_products == "auto"
    for text, value in (("auto", "auto"), ("1", True), ("false", False), ("AUTO", "auto")):
        assert tpucompile.Options.from_sources(None, {"TPUCOMPILE_NARROW_PRODUCTS": text}).narrow_products == value
    for bad in ("sometimes", 1, None):
        with pytest.raises(tpucompile.OptionsError, match="narrow_products"):
            tpucompile.Options.from_sources({"narrow_products": bad})


def test_options_reach_the_compiler():
    # A limit of 0 lifts every tensor constant into an argument; the result must not change.
    table = torch.arange(12.0).reshape(3, 4)
    assert_compiles_like_eager(lambda x: x + table, torch.randn(3, 4), embed_constant_limit=0)
    assert_compiles_like_eager(lambda x: x + table, torch.randn(3, 4), embed_constant_limit=100)


class _Counter(nn.Module):
    """Mutates a buffer in place on every call, like BatchNorm's num_batches_tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.calls += 1
        self.total.add_(x.sum(0))
        return x * self.calls


def test_buffer_mutations_are_written_back():
    eager, model = _Counter(), _Counter()
    compiled = torch.compile(model, backend="tpucompile", fullgraph=True)
    for _ in range(3):
        x = torch.randn(2, 4)
        assert_close_tree(compiled(x), eager(x))
    assert_close_tree(model.calls, eager.calls)
    assert_close_tree(model.total, eager.total)


def test_in_place_update_of_an_input():
    def f(x, y):
        x.mul_(2)
        return x + y

    x, y = torch.randn(3), torch.randn(3)
    x_eager = x.clone()
    expected = f(x_eager, y)
    before = driver.graphs_compiled()
    actual = compile_fn(f)(x, y)
    assert driver.graphs_compiled() > before
    assert_close_tree(actual, expected)
    assert_close_tree(x, x_eager)


def test_batchnorm_train_mode_updates_running_stats():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU())
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="tpucompile", fullgraph=True)
    for _ in range(2):
        x = torch.randn(8, 6)
        out, expected = compiled(x), eager(x)
        assert_close_tree(out, expected)
        out.sum().backward()
        expected.sum().backward()
    bn, bn_eager = model[1], eager[1]
    assert_close_tree(bn.running_mean, bn_eager.running_mean)
    assert_close_tree(bn.running_var, bn_eager.running_var)
    assert_close_tree(bn.num_batches_tracked, bn_eager.num_batches_tracked)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert_close_tree(p.grad, q.grad)


def test_dynamic_shapes_compile_once_per_shape_and_log_reason(caplog):
    """``dynamic_mode="exact"``: one executable per concrete size (buckets, the default, in
    ``tests/runtime/test_buckets.py``)."""
    layer = nn.Linear(8, 3)
    compiled = torch.compile(layer, backend="tpucompile", options={"dynamic_mode": "exact"})
    caplog.set_level(logging.INFO, logger="tpucompile")
    with torch.no_grad():
        for batch in (2, 5, 9, 5, 9):
            x = torch.randn(batch, 8)
            assert_close_tree(compiled(x), layer(x))
    recompiles = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    # Dynamo specialises on the first shape, then hands over one symbolic graph for the second; that graph
    # compiles for 5, then once more for 9; the repeated shapes reuse their executables.
    assert len(recompiles) == 1, recompiles
    assert "dim 0: 5 -> 9" in recompiles[0]


def test_dynamic_shapes_training():
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    compiled = torch.compile(layer, backend="tpucompile")
    for batch in (3, 6, 7):
        x = torch.randn(batch, 4, requires_grad=True)
        compiled(x).pow(2).sum().backward()
        grad = x.grad.clone()
        x.grad = None
        layer(x).pow(2).sum().backward()
        assert_close_tree(grad, x.grad)


def test_executable_cache_shares_identical_graphs():
    cache = driver.executable_cache()
    assert_compiles_like_eager(lambda x: x.cos() + 3, torch.randn(4, 4))
    hits = cache.stats.hits
    assert_compiles_like_eager(lambda y: y.cos() + 3, torch.randn(4, 4))
    assert cache.stats.hits == hits + 1


@torch.library.custom_op("tpucompile_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.numpy().copy())  # numpy: the implementation cannot be traced into the graph


@_mystery.register_fake
def _(x):
    return torch.empty_like(x)


def test_unsupported_op_names_op_and_source_line():
    def model(x):
        y = x + 1
        return torch.ops.tpucompile_test.mystery(y)  # the unsupported line

    with pytest.raises(Exception) as info:
        compile_fn(model, fallback="error")(torch.randn(3))
    message = str(info.value)
    assert "UnsupportedOpError: no lowering for tpucompile_test.mystery.default(float32[3])" in message
    assert f"{os.path.basename(__file__)}:" in message and "the unsupported line" in message
    assert "MLIR" not in message.split("UnsupportedOpError")[0]


def test_unsupported_dtype_names_dtype_and_source_line():
    def model(x):
        return torch.view_as_complex(x.half()).abs()  # complex32: two float16s, which XLA has no type for

    with pytest.raises(Exception) as info:
        compile_fn(model, fallback="error")(torch.randn(3, 2))
    message = str(info.value)
    assert "complex32" in message and "is not supported" in message
    assert "view_as_complex" in message


def test_roll_layers_takes_a_bool_or_auto():
    from tpucompile.config import Options, roll_layers_for

    assert Options.from_sources({"roll_layers": "0"}).roll_layers is False
    assert Options.from_sources({}).roll_layers == "auto"
    with pytest.raises(tpucompile.OptionsError, match="roll_layers"):
        Options.from_sources({"roll_layers": "sometimes"})
    assert roll_layers_for("auto", {"cpu"}, None) and not roll_layers_for("auto", {"cpu", "tpu"}, None)
    assert not roll_layers_for("auto", {"cpu"}, object()) and roll_layers_for(True, {"tpu"}, None)
    assert not roll_layers_for(False, {"cpu"}, None)


def test_a_loop_that_fails_to_compile_leaves_the_layers_unrolled(monkeypatch):
    """Rolling never fails a compile: whatever goes wrong with the loop, the layers compile as Dynamo traced
    them, with a warning that says why."""
    from tpucompile.lowering import loops

    def broken(*args, **kwargs):
        raise RuntimeError("a loop this lowering cannot build")

    monkeypatch.setattr(loops, "lower_scan", broken)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3)])
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    with pytest.warns(tpucompile.TpuCompileWarning, match="unrolled: rolled into a loop it failed"):
        out = torch.compile(net, backend="tpucompile", options={"roll_layers": True, "cache_mode": "off"})(x)
    torch.testing.assert_close(out, net(x))
